package helm

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"
)

const (
	chartDir = "troupe"
	// A cluster token of the required 16 bytes and more, for rendering.
	testToken = "0123456789abcdef0123456789abcdef"
)

// valuesFiles are the chart's values files; "" is values.yaml alone.
var valuesFiles = []string{"", "values-vllm.yaml", "values-vllm-omni.yaml", "values-autoscaling.yaml"}

// copies are the chart's copies of files owned elsewhere in the repository
// (Helm reads only files inside the chart, and ignores symlinks out of it).
var copies = map[string]string{
	"troupe/files/rules.yml":   "../prometheus/rules.yml",
	"troupe/files/troupe.json": "../grafana/troupe.json",
}

// TestCopiesMatchTheirOwners: the chart's rules and dashboard are
// deploy/prometheus/rules.yml and deploy/grafana/troupe.json, byte for byte.
func TestCopiesMatchTheirOwners(t *testing.T) {
	for cp, owner := range copies {
		got, err := os.ReadFile(cp)
		if err != nil {
			t.Fatal(err)
		}
		want, err := os.ReadFile(owner)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s differs from %s: run cp %s %s", cp, owner, owner, cp)
		}
	}
}

// objects are one rendering's objects by kind and name.
type objects struct {
	deployments  map[string]*appsv1.Deployment
	statefulSets map[string]*appsv1.StatefulSet
	services     map[string]*corev1.Service
	configMaps   map[string]*corev1.ConfigMap
	secrets      map[string]*corev1.Secret
	pdbs         map[string]*policyv1.PodDisruptionBudget
	rules        map[string]*prometheusRule
	podMonitors  map[string]*podMonitor
	hpas         map[string]*autoscalingv2.HorizontalPodAutoscaler
	scaled       map[string]*scaledObject
	netpols      map[string]*networkingv1.NetworkPolicy
	pvcs         map[string]*corev1.PersistentVolumeClaim
	certs        map[string]*certificate
}

// certificate is the part of cert-manager's Certificate (cert-manager.io/v1,
// a CRD) the chart writes.
type certificate struct {
	APIVersion string         `json:"apiVersion"`
	Kind       string         `json:"kind"`
	Metadata   map[string]any `json:"metadata"`
	Spec       struct {
		SecretName  string   `json:"secretName"`
		Duration    string   `json:"duration"`
		RenewBefore string   `json:"renewBefore"`
		CommonName  string   `json:"commonName"`
		DNSNames    []string `json:"dnsNames"`
		IPAddresses []string `json:"ipAddresses"`
		Usages      []string `json:"usages"`
		PrivateKey  struct {
			Algorithm      string `json:"algorithm"`
			Size           int    `json:"size"`
			RotationPolicy string `json:"rotationPolicy"`
		} `json:"privateKey"`
		IssuerRef struct {
			Name  string `json:"name"`
			Kind  string `json:"kind"`
			Group string `json:"group"`
		} `json:"issuerRef"`
	} `json:"spec"`
}

// scaledObject is the part of KEDA's ScaledObject (keda.sh/v1alpha1, a
// CRD, not in k8s.io/api) the chart writes.
type scaledObject struct {
	APIVersion string         `json:"apiVersion"`
	Kind       string         `json:"kind"`
	Metadata   map[string]any `json:"metadata"`
	Spec       struct {
		ScaleTargetRef struct {
			Name string `json:"name"`
		} `json:"scaleTargetRef"`
		MinReplicaCount int32 `json:"minReplicaCount"`
		MaxReplicaCount int32 `json:"maxReplicaCount"`
		PollingInterval int32 `json:"pollingInterval"`
		Advanced        struct {
			HorizontalPodAutoscalerConfig struct {
				Behavior autoscalingv2.HorizontalPodAutoscalerBehavior `json:"behavior"`
			} `json:"horizontalPodAutoscalerConfig"`
		} `json:"advanced"`
		Triggers []struct {
			Type     string `json:"type"`
			Metadata struct {
				ServerAddress string `json:"serverAddress"`
				Query         string `json:"query"`
				Threshold     string `json:"threshold"`
			} `json:"metadata"`
		} `json:"triggers"`
	} `json:"spec"`
}

// podMonitor is the part of prometheus-operator's PodMonitor the chart
// writes.
type podMonitor struct {
	APIVersion string         `json:"apiVersion"`
	Kind       string         `json:"kind"`
	Metadata   map[string]any `json:"metadata"`
	Spec       struct {
		JobLabel string `json:"jobLabel"`
		Selector struct {
			MatchLabels map[string]string `json:"matchLabels"`
		} `json:"selector"`
		PodMetricsEndpoints []struct {
			Port     string `json:"port"`
			Path     string `json:"path"`
			Interval string `json:"interval"`
		} `json:"podMetricsEndpoints"`
	} `json:"spec"`
}

// prometheusRule is the part of prometheus-operator's PrometheusRule the
// chart writes (the type is a CRD, not in k8s.io/api).
type prometheusRule struct {
	APIVersion string         `json:"apiVersion"`
	Kind       string         `json:"kind"`
	Metadata   map[string]any `json:"metadata"`
	Spec       struct {
		Groups []any `json:"groups"`
	} `json:"spec"`
}

func loadChart(t *testing.T) *chart.Chart {
	t.Helper()
	c, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// values reads a values file over the chart's defaults and applies set
// (dotted keys) over it, as `helm -f file --set k=v` does.
func values(t *testing.T, file string, set map[string]any) map[string]any {
	t.Helper()
	vals := map[string]any{}
	if file != "" {
		v, err := chartutil.ReadValuesFile(filepath.Join(chartDir, file))
		if err != nil {
			t.Fatal(err)
		}
		vals = v.AsMap()
	}
	for key, v := range set {
		m := vals
		parts := strings.Split(key, ".")
		for _, p := range parts[:len(parts)-1] {
			next, ok := m[p].(map[string]any)
			if !ok {
				next = map[string]any{}
				m[p] = next
			}
			m = next
		}
		m[parts[len(parts)-1]] = v
	}
	return vals
}

func render(c *chart.Chart, vals map[string]any) (map[string]string, error) {
	rv, err := chartutil.ToRenderValues(c, vals, chartutil.ReleaseOptions{Name: "demo", Namespace: "troupe", IsInstall: true}, nil)
	if err != nil {
		return nil, err
	}
	return engine.Render(c, rv)
}

var docSeparator = regexp.MustCompile(`(?m)^---\s*$`)

// decodeStrict decodes one YAML document into v, refusing unknown fields.
func decodeStrict(doc string, v any) error {
	js, err := yaml.YAMLToJSON([]byte(doc))
	if err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields()
	return dec.Decode(v)
}

// decodeAll strict-decodes every rendered object into its API type.
func decodeAll(t *testing.T, rendered map[string]string) *objects {
	t.Helper()
	o := &objects{
		deployments: map[string]*appsv1.Deployment{}, statefulSets: map[string]*appsv1.StatefulSet{},
		services: map[string]*corev1.Service{}, configMaps: map[string]*corev1.ConfigMap{},
		secrets: map[string]*corev1.Secret{}, pdbs: map[string]*policyv1.PodDisruptionBudget{},
		rules: map[string]*prometheusRule{}, podMonitors: map[string]*podMonitor{},
		hpas: map[string]*autoscalingv2.HorizontalPodAutoscaler{}, scaled: map[string]*scaledObject{},
		netpols: map[string]*networkingv1.NetworkPolicy{}, pvcs: map[string]*corev1.PersistentVolumeClaim{},
		certs: map[string]*certificate{},
	}
	names := make([]string, 0, len(rendered))
	for n := range rendered {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, file := range names {
		if !strings.HasSuffix(file, ".yaml") {
			continue // NOTES.txt, helpers
		}
		for _, doc := range docSeparator.Split(rendered[file], -1) {
			var head struct {
				APIVersion string `json:"apiVersion"`
				Kind       string `json:"kind"`
				Metadata   struct {
					Name string `json:"name"`
				} `json:"metadata"`
			}
			if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
				t.Fatalf("%s: %v\n%s", file, err, doc)
			}
			if head.Kind == "" {
				if strings.TrimSpace(stripComments(doc)) != "" {
					t.Fatalf("%s: a document without kind:\n%s", file, doc)
				}
				continue
			}
			var obj any
			switch head.APIVersion + " " + head.Kind {
			case "apps/v1 Deployment":
				d := &appsv1.Deployment{}
				o.deployments[head.Metadata.Name], obj = d, d
			case "apps/v1 StatefulSet":
				s := &appsv1.StatefulSet{}
				o.statefulSets[head.Metadata.Name], obj = s, s
			case "v1 Service":
				s := &corev1.Service{}
				o.services[head.Metadata.Name], obj = s, s
			case "v1 ConfigMap":
				c := &corev1.ConfigMap{}
				o.configMaps[head.Metadata.Name], obj = c, c
			case "v1 Secret":
				s := &corev1.Secret{}
				o.secrets[head.Metadata.Name], obj = s, s
			case "policy/v1 PodDisruptionBudget":
				p := &policyv1.PodDisruptionBudget{}
				o.pdbs[head.Metadata.Name], obj = p, p
			case "monitoring.coreos.com/v1 PodMonitor":
				m := &podMonitor{}
				o.podMonitors[head.Metadata.Name], obj = m, m
			case "monitoring.coreos.com/v1 PrometheusRule":
				r := &prometheusRule{}
				o.rules[head.Metadata.Name], obj = r, r
			case "autoscaling/v2 HorizontalPodAutoscaler":
				h := &autoscalingv2.HorizontalPodAutoscaler{}
				o.hpas[head.Metadata.Name], obj = h, h
			case "keda.sh/v1alpha1 ScaledObject":
				so := &scaledObject{}
				o.scaled[head.Metadata.Name], obj = so, so
			case "networking.k8s.io/v1 NetworkPolicy":
				np := &networkingv1.NetworkPolicy{}
				o.netpols[head.Metadata.Name], obj = np, np
			case "v1 PersistentVolumeClaim":
				pvc := &corev1.PersistentVolumeClaim{}
				o.pvcs[head.Metadata.Name], obj = pvc, pvc
			case "cert-manager.io/v1 Certificate":
				c := &certificate{}
				o.certs[head.Metadata.Name], obj = c, c
			default:
				t.Fatalf("%s: unexpected object %s %s", file, head.APIVersion, head.Kind)
			}
			if err := decodeStrict(doc, obj); err != nil {
				t.Fatalf("%s: %s %s: %v", file, head.Kind, head.Metadata.Name, err)
			}
		}
	}
	return o
}

func stripComments(doc string) string {
	var b strings.Builder
	for _, line := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			b.WriteString(line + "\n")
		}
	}
	return b.String()
}

// TestChartRenders renders every values file and checks the objects'
// references to each other and to the flags they run with.
func TestChartRenders(t *testing.T) {
	c := loadChart(t)
	for _, file := range valuesFiles {
		name := file
		if name == "" {
			name = "values.yaml"
		}
		t.Run(name, func(t *testing.T) {
			rendered, err := render(c, values(t, file, map[string]any{
				"clusterToken.value":                testToken,
				"monitoring.prometheusRule.enabled": true,
				"monitoring.podMonitor.enabled":     true,
				"head.apiKeySecret.name":            "api-key",
			}))
			if err != nil {
				t.Fatal(err)
			}
			o := decodeAll(t, rendered)
			checkObjects(t, o, false)
		})
	}
}

// TestExternalEtcdAndExistingSecret: with external etcd endpoints no etcd is
// deployed and every troupe process dials them; an existing Secret is
// mounted and none is created.
func TestExternalEtcdAndExistingSecret(t *testing.T) {
	c := loadChart(t)
	endpoints := []any{"http://etcd-0.etcd:2379", "http://etcd-1.etcd:2379", "http://etcd-2.etcd:2379"}
	rendered, err := render(c, values(t, "", map[string]any{
		"etcd.external.endpoints":     endpoints,
		"clusterToken.existingSecret": "my-token",
	}))
	if err != nil {
		t.Fatal(err)
	}
	o := decodeAll(t, rendered)
	if len(o.statefulSets) != 0 {
		t.Errorf("external etcd: the chart still deploys %d StatefulSets", len(o.statefulSets))
	}
	if len(o.secrets) != 0 {
		t.Errorf("existingSecret: the chart still creates %d Secrets", len(o.secrets))
	}
	for name, d := range o.deployments {
		got := flagValue(t, d.Spec.Template.Spec.Containers[0], "etcd-endpoints")
		if want := "http://etcd-0.etcd:2379,http://etcd-1.etcd:2379,http://etcd-2.etcd:2379"; got != want {
			t.Errorf("%s: --etcd-endpoints=%s, want %s", name, got, want)
		}
		if s := secretVolume(d.Spec.Template.Spec, "cluster-token"); s != "my-token" {
			t.Errorf("%s: cluster-token volume from Secret %q, want my-token", name, s)
		}
	}
	checkObjects(t, o, true)
}

// TestEtcdThreeMembers: etcd.replicas=3 renders a StatefulSet of three
// members started in parallel, each named after its pod, whose
// --initial-cluster names every member at its stable DNS name through the
// headless Service, on the peer port that Service and the container expose,
// and a PodDisruptionBudget that lets one member go at a time.
func TestEtcdThreeMembers(t *testing.T) {
	c := loadChart(t)
	rendered, err := render(c, values(t, "", map[string]any{"clusterToken.value": testToken, "etcd.replicas": 3}))
	if err != nil {
		t.Fatal(err)
	}
	o := decodeAll(t, rendered)
	checkObjects(t, o, false)
	const sts, ns = "demo-troupe-etcd", "troupe"
	s, ok := o.statefulSets[sts]
	if !ok {
		t.Fatalf("no StatefulSet %s among %v", sts, slices.Collect(maps.Keys(o.statefulSets)))
	}
	if s.Spec.Replicas == nil || *s.Spec.Replicas != 3 {
		t.Errorf("replicas %v, want 3", s.Spec.Replicas)
	}
	if s.Spec.PodManagementPolicy != appsv1.ParallelPodManagement {
		t.Errorf("podManagementPolicy %q, want Parallel: no member is ready before a quorum", s.Spec.PodManagementPolicy)
	}
	if len(s.Spec.VolumeClaimTemplates) == 0 {
		t.Errorf("no volume claim templates: a member must keep its data dir across restarts")
	}
	hl, ok := o.services[s.Spec.ServiceName]
	if !ok || hl.Spec.ClusterIP != corev1.ClusterIPNone || !hl.Spec.PublishNotReadyAddresses {
		t.Fatalf("serviceName %s: want a headless Service publishing not-ready pods, got %+v", s.Spec.ServiceName, hl)
	}
	ct := s.Spec.Template.Spec.Containers[0]
	if !envFromField(ct, "POD_NAME", "metadata.name") {
		t.Errorf("no POD_NAME from metadata.name")
	}
	if got := flagValue(t, ct, "name"); got != "$(POD_NAME)" {
		t.Errorf("--name=%s, want $(POD_NAME)", got)
	}
	if got := flagValue(t, ct, "initial-cluster-state"); got != "new" {
		t.Errorf("--initial-cluster-state=%s, want new", got)
	}
	peerPort := portOf(t, "--listen-peer-urls", flagValue(t, ct, "listen-peer-urls"))
	if containerPort(ct, intstr.FromString("peer")) != peerPort {
		t.Errorf("container port peer is not --listen-peer-urls' port %d", peerPort)
	}
	if !slices.ContainsFunc(hl.Spec.Ports, func(p corev1.ServicePort) bool { return p.Port == peerPort }) {
		t.Errorf("headless Service %s has no port %d for peers", hl.Name, peerPort)
	}
	// Each pod's --initial-advertise-peer-urls (POD_NAME substituted, as
	// the kubelet does) must be its own entry of --initial-cluster, and
	// the list must name every pod and nothing else.
	cluster := map[string]string{}
	for _, m := range strings.Split(flagValue(t, ct, "initial-cluster"), ",") {
		n, u, ok := strings.Cut(m, "=")
		if !ok {
			t.Fatalf("--initial-cluster entry %q is not name=URL", m)
		}
		cluster[n] = u
	}
	if len(cluster) != 3 {
		t.Errorf("--initial-cluster names %d members, want 3: %v", len(cluster), cluster)
	}
	for i := range 3 {
		pod := fmt.Sprintf("%s-%d", sts, i)
		want := fmt.Sprintf("http://%s.%s.%s.svc:%d", pod, hl.Name, ns, peerPort)
		if cluster[pod] != want {
			t.Errorf("--initial-cluster gives %s %q, want %q", pod, cluster[pod], want)
		}
		adv := strings.ReplaceAll(flagValue(t, ct, "initial-advertise-peer-urls"), "$(POD_NAME)", pod)
		if adv != cluster[pod] {
			t.Errorf("%s advertises peer URL %s, the cluster lists %s", pod, adv, cluster[pod])
		}
	}
	pdb, ok := o.pdbs[sts]
	if !ok {
		t.Fatalf("no PodDisruptionBudget %s", sts)
	}
	if pdb.Spec.MaxUnavailable == nil || pdb.Spec.MaxUnavailable.IntValue() != 1 {
		t.Errorf("etcd PodDisruptionBudget maxUnavailable %v, want 1", pdb.Spec.MaxUnavailable)
	}
	if !subset(pdb.Spec.Selector.MatchLabels, s.Spec.Template.Labels) {
		t.Errorf("etcd PodDisruptionBudget selects %v, not the etcd pods %v", pdb.Spec.Selector.MatchLabels, s.Spec.Template.Labels)
	}
}

// TestChartRefusesBrokenValues: values that would render a broken cluster
// fail the rendering with a message that says what to set.
func TestChartRefusesBrokenValues(t *testing.T) {
	c := loadChart(t)
	for _, tc := range []struct {
		name string
		set  map[string]any
		want string
	}{
		{"no token", map[string]any{}, "clusterToken"},
		{"short token", map[string]any{"clusterToken.value": "short"}, "16 bytes"},
		{"two etcd members", map[string]any{"clusterToken.value": testToken, "etcd.replicas": 2}, "etcd.replicas: 1 or 3 members"},
		{"three etcd members without volumes", map[string]any{"clusterToken.value": testToken, "etcd.replicas": 3,
			"etcd.persistence.enabled": false}, "3 members need etcd.persistence.enabled"},
		{"stage without workers", map[string]any{"clusterToken.value": testToken,
			"pipeline.stages": []any{map[string]any{"name": "thinker"}, map[string]any{"name": "speech"}}}, `stage "speech" has no entry in stages`},
		{"stage name not a DNS label", map[string]any{"clusterToken.value": testToken,
			"stages": []any{map[string]any{"name": "Thinker_1", "replicas": 1}}}, "not a DNS label"},
		{"hpa and keda", map[string]any{"clusterToken.value": testToken,
			"autoscaling.hpa.enabled": true, "autoscaling.keda.enabled": true}, "not both"},
		{"keda without prometheus", map[string]any{"clusterToken.value": testToken,
			"autoscaling.keda.enabled": true}, "autoscaling.keda.serverAddress"},
		{"gpu without sidecar", map[string]any{"clusterToken.value": testToken,
			"stages": []any{map[string]any{"name": "thinker", "replicas": 1, "gpu": 1}}}, "gpu goes to the stage's first sidecar"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := render(c, values(t, "", tc.set))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("render: %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// lintFails is how `helm lint` decides its exit status (helm's
// action.Lint): a message at ErrorSev or above, or with --strict at
// WarningSev or above, makes the chart failed and the CLI exit 1.
func lintFails(msgs []support.Message, strict bool) []support.Message {
	lowest := support.ErrorSev
	if strict {
		lowest = support.WarningSev
	}
	var failed []support.Message
	for _, m := range msgs {
		if m.Severity >= lowest {
			failed = append(failed, m)
		}
	}
	return failed
}

// TestLint runs `helm lint --strict`'s checks (in process) on every values
// file: no message may fail it.
func TestLint(t *testing.T) {
	for _, file := range valuesFiles {
		vals := values(t, file, map[string]any{"clusterToken.value": testToken})
		linter := lint.All(chartDir, vals, "troupe", false)
		for _, m := range lintFails(linter.Messages, true) {
			t.Errorf("%s: %s", file, m)
		}
	}
}

// TestLintFailsWithoutToken: `helm lint` of the chart as shipped, without
// a cluster token, fails, also without --strict: the chart's refusal is an
// ErrorSev message (the CLI prints "1 chart(s) failed" and exits 1), not a
// warning that lets it pass.
//
// helm's lint mode turns the templates' fail into a log line ("[INFO]
// Fail: ...") and renders on; the chart's troupe.fail then renders a
// document that is not YAML, which the lint reports as an error.
func TestLintFailsWithoutToken(t *testing.T) {
	var logs bytes.Buffer
	log.SetOutput(&logs)
	defer log.SetOutput(os.Stderr)
	for _, tc := range []struct {
		name, want string
		set        map[string]any
	}{
		{"no token", "Fail: clusterToken", map[string]any{}},
		{"keda without server", "Fail: autoscaling.keda.serverAddress", map[string]any{"clusterToken.value": testToken, "autoscaling.keda.enabled": true}},
	} {
		logs.Reset()
		linter := lint.All(chartDir, values(t, "", tc.set), "troupe", false)
		if failed := lintFails(linter.Messages, false); len(failed) == 0 {
			t.Errorf("%s: helm lint fails nothing (messages %v): the CLI would exit 0", tc.name, linter.Messages)
		}
		if !strings.Contains(logs.String(), tc.want) {
			t.Errorf("%s: helm's log %q, want %q", tc.name, logs.String(), tc.want)
		}
	}
}

// checkObjects checks the references of one rendering.
func checkObjects(t *testing.T, o *objects, externalEtcd bool) {
	t.Helper()
	workloads := map[string]corev1.PodTemplateSpec{}
	claims := map[string][]string{} // a StatefulSet's volume claim templates, by workload
	for name, d := range o.deployments {
		checkSelector(t, "Deployment "+name, d.Spec.Selector.MatchLabels, d.Spec.Template.Labels)
		workloads[name] = d.Spec.Template
	}
	for name, s := range o.statefulSets {
		checkSelector(t, "StatefulSet "+name, s.Spec.Selector.MatchLabels, s.Spec.Template.Labels)
		if _, ok := o.services[s.Spec.ServiceName]; !ok {
			t.Errorf("StatefulSet %s: serviceName %s is no Service", name, s.Spec.ServiceName)
		}
		workloads[name] = s.Spec.Template
		for _, c := range s.Spec.VolumeClaimTemplates {
			claims[name] = append(claims[name], c.Name)
		}
	}
	for name, s := range o.services {
		tmpl, ok := selected(workloads, s.Spec.Selector)
		if !ok {
			t.Errorf("Service %s: selector %v matches no workload's pods", name, s.Spec.Selector)
			continue
		}
		for _, p := range s.Spec.Ports {
			if !hasPort(tmpl.Spec.Containers, p.TargetPort) {
				t.Errorf("Service %s: targetPort %s is no container port", name, p.TargetPort.String())
			}
		}
	}
	for name, p := range o.pdbs {
		if _, ok := selected(workloads, p.Spec.Selector.MatchLabels); !ok {
			t.Errorf("PodDisruptionBudget %s: selector matches no workload's pods", name)
		}
	}
	for name, tmpl := range workloads {
		spec := tmpl.Spec
		for _, v := range spec.Volumes {
			if v.ConfigMap != nil {
				if _, ok := o.configMaps[v.ConfigMap.Name]; !ok {
					t.Errorf("%s: volume %s: no ConfigMap %s", name, v.Name, v.ConfigMap.Name)
				}
			}
			if v.Secret != nil && v.Name == "cluster-token" && !externalEtcd {
				if _, ok := o.secrets[v.Secret.SecretName]; !ok {
					t.Errorf("%s: volume %s: no Secret %s", name, v.Name, v.Secret.SecretName)
				}
			}
		}
		for _, ct := range spec.Containers {
			for _, m := range ct.VolumeMounts {
				if !hasVolume(spec, m.Name) && !slices.Contains(claims[name], m.Name) {
					t.Errorf("%s: container %s mounts %s, no volume of the pod", name, ct.Name, m.Name)
				}
			}
		}
		checkTroupeContainer(t, name, tmpl, o, externalEtcd)
	}
	checkPipeline(t, o)
	checkAutoscalers(t, o)
	checkPodSecurity(t, workloads)
	checkClaims(t, o, workloads)
	checkNetworkPolicies(t, o, workloads)
	checkCertificates(t, o, workloads)
	for name, m := range o.podMonitors {
		checkPodMonitor(t, name, m, workloads)
	}
	if len(o.rules) > 0 && len(o.podMonitors) == 0 {
		t.Errorf("a PrometheusRule without the PodMonitor: nothing scrapes job troupe-head")
	}
	for name, r := range o.rules {
		checkRules(t, name, r)
	}
	for name, cm := range o.configMaps {
		if cm.Labels["grafana_dashboard"] != "1" {
			continue
		}
		want, err := os.ReadFile("../grafana/troupe.json")
		if err != nil {
			t.Fatal(err)
		}
		if got := cm.Data["troupe.json"]; got != string(want) {
			t.Errorf("ConfigMap %s: troupe.json is not deploy/grafana/troupe.json (%d bytes, want %d)", name, len(got), len(want))
		}
		if !json.Valid([]byte(cm.Data["troupe.json"])) {
			t.Errorf("ConfigMap %s: troupe.json is not JSON", name)
		}
	}
}

// checkTroupeContainer checks the troupe container's probes and grace
// period against the flags it runs with.
func checkTroupeContainer(t *testing.T, name string, tmpl corev1.PodTemplateSpec, o *objects, externalEtcd bool) {
	t.Helper()
	ct := tmpl.Spec.Containers[0]
	if len(ct.Args) == 0 {
		t.Fatalf("%s: container %s has no args", name, ct.Name)
	}
	for _, p := range []*corev1.Probe{ct.ReadinessProbe, ct.LivenessProbe} {
		if p == nil {
			continue
		}
		switch {
		case p.HTTPGet != nil:
			if !hasPort([]corev1.Container{ct}, p.HTTPGet.Port) {
				t.Errorf("%s: probe port %s is no container port", name, p.HTTPGet.Port.String())
			}
		case p.GRPC != nil:
			if !hasPort([]corev1.Container{ct}, intstr.FromInt32(p.GRPC.Port)) {
				t.Errorf("%s: gRPC probe port %d is no container port", name, p.GRPC.Port)
			}
		}
	}
	if ct.ReadinessProbe == nil {
		t.Fatalf("%s: no readiness probe", name)
	}
	if ct.LivenessProbe == nil {
		t.Fatalf("%s: no liveness probe", name)
	}
	// Resources: requests (scheduling, CPU autoscaling) and a memory limit.
	req, lim := ct.Resources.Requests, ct.Resources.Limits
	if req.Cpu().IsZero() || req.Memory().IsZero() || lim.Memory().IsZero() {
		t.Errorf("%s: resources %+v, want cpu and memory requests and a memory limit", name, ct.Resources)
	} else if lim.Memory().Cmp(*req.Memory()) < 0 {
		t.Errorf("%s: memory limit %s below its request %s", name, lim.Memory(), req.Memory())
	}
	grace := time.Duration(0)
	if tmpl.Spec.TerminationGracePeriodSeconds != nil {
		grace = time.Duration(*tmpl.Spec.TerminationGracePeriodSeconds) * time.Second
	}
	switch ct.Args[0] {
	case "head":
		port := portOf(t, name, flagValue(t, ct, "http"))
		rp := ct.ReadinessProbe.HTTPGet
		if rp == nil || rp.Path != "/readyz" || containerPort(ct, rp.Port) != port {
			t.Errorf("%s: readiness %+v, want GET /readyz on --http's port %d", name, rp, port)
		}
		if lp := ct.LivenessProbe; lp == nil || lp.HTTPGet == nil || lp.HTTPGet.Path != "/healthz" || containerPort(ct, lp.HTTPGet.Port) != port {
			t.Errorf("%s: liveness %+v, want GET /healthz on port %d", name, lp, port)
		}
		need := duration(t, name, flagValue(t, ct, "shutdown-delay")) + duration(t, name, flagValue(t, ct, "drain-timeout"))
		if grace <= need {
			t.Errorf("%s: terminationGracePeriodSeconds %v, want more than --shutdown-delay + --drain-timeout = %v", name, grace, need)
		}
		pipe := flagValue(t, ct, "pipeline")
		if !mounted(ct, pipe) {
			t.Errorf("%s: --pipeline=%s is in no mount", name, pipe)
		}
		if ann := tmpl.Annotations; ann["prometheus.io/scrape"] != "true" || ann["prometheus.io/port"] != fmt.Sprint(port) {
			t.Errorf("%s: scrape annotations %v, want the head's port %d", name, ann, port)
		}
	case "worker":
		port := portOf(t, name, flagValue(t, ct, "listen"))
		if g := ct.ReadinessProbe.GRPC; g == nil || g.Port != port {
			t.Errorf("%s: readiness %+v, want gRPC health on --listen's port %d", name, ct.ReadinessProbe, port)
		}
		// Liveness must not follow the gRPC health, which is NOT_SERVING
		// while the worker drains or its upstream loads: GET /healthz on
		// the metrics listener.
		mp := portOf(t, name, flagValue(t, ct, "metrics-listen"))
		if lp := ct.LivenessProbe.HTTPGet; lp == nil || lp.Path != "/healthz" || containerPort(ct, lp.Port) != mp {
			t.Errorf("%s: liveness %+v, want GET /healthz on --metrics-listen's port %d", name, ct.LivenessProbe, mp)
		}
		if adv := flagValue(t, ct, "advertise"); adv != fmt.Sprintf("$(POD_IP):%d", port) {
			t.Errorf("%s: --advertise=%s, want $(POD_IP):%d", name, adv, port)
		}
		if !envFromField(ct, "POD_IP", "status.podIP") {
			t.Errorf("%s: no POD_IP from status.podIP", name)
		}
		mport := portOf(t, name, flagValue(t, ct, "metrics-listen"))
		if !hasPort([]corev1.Container{ct}, intstr.FromInt32(mport)) {
			t.Errorf("%s: --metrics-listen's port %d is no container port", name, mport)
		}
		if ann := tmpl.Annotations; ann["prometheus.io/scrape"] != "true" || ann["prometheus.io/port"] != fmt.Sprint(mport) {
			t.Errorf("%s: scrape annotations %v, want the worker's metrics port %d", name, ann, mport)
		}
		if id := flagValue(t, ct, "replica-id"); id != "auto" {
			t.Errorf("%s: --replica-id=%s, want auto", name, id)
		}
		if need := duration(t, name, flagValue(t, ct, "drain-timeout")); grace <= need {
			t.Errorf("%s: terminationGracePeriodSeconds %v, want more than --drain-timeout %v", name, grace, need)
		}
	case "etcd":
		listen := flagValue(t, ct, "listen-client-urls")
		port := portOf(t, name, listen)
		tls := strings.HasPrefix(listen, "https://")
		mutual := slices.ContainsFunc(ct.Args, func(a string) bool { return strings.HasPrefix(a, "--trusted-ca-file=") })
		if tls {
			for _, f := range []string{"cert-file", "key-file"} {
				if !mounted(ct, flagValue(t, ct, f)) {
					t.Errorf("%s: --%s is in no mount", name, f)
				}
			}
		}
		for what, p := range map[string]*corev1.Probe{"readiness": ct.ReadinessProbe, "liveness": ct.LivenessProbe} {
			switch {
			case mutual:
				// The kubelet has no client certificate: a TCP probe.
				if p.TCPSocket == nil || containerPort(ct, p.TCPSocket.Port) != port {
					t.Errorf("%s: %s %+v under mutual TLS, want a TCP probe of the client port %d", name, what, p, port)
				}
			case p.HTTPGet == nil || p.HTTPGet.Path != "/health" || containerPort(ct, p.HTTPGet.Port) != port:
				t.Errorf("%s: %s %+v, want GET /health on the client port %d", name, what, p, port)
			case tls != (p.HTTPGet.Scheme == corev1.URISchemeHTTPS):
				t.Errorf("%s: %s scheme %q for client URLs %s", name, what, p.HTTPGet.Scheme, listen)
			}
		}
		if !mounted(ct, flagValue(t, ct, "data-dir")) {
			t.Errorf("%s: --data-dir is in no mount", name)
		}
		return
	default:
		t.Fatalf("%s: unknown troupe command %q", name, ct.Args[0])
	}
	tok := flagValue(t, ct, "cluster-token-file")
	if !mounted(ct, tok) {
		t.Errorf("%s: --cluster-token-file=%s is in no mount", name, tok)
	}
	if !externalEtcd {
		ep := flagValue(t, ct, "etcd-endpoints")
		_, rest, _ := strings.Cut(ep, "://")
		host := strings.Split(rest, ":")[0]
		if _, ok := o.services[host]; !ok {
			t.Errorf("%s: --etcd-endpoints=%s names no Service", name, ep)
		}
	}
}

// checkPipeline: every stage of the heads' pipeline has a Deployment of
// workers with that --stage.
func checkPipeline(t *testing.T, o *objects) {
	t.Helper()
	var pipe struct {
		Model  string `json:"model"`
		Stages []struct {
			Name string `json:"name"`
		} `json:"stages"`
	}
	found := false
	for name, cm := range o.configMaps {
		text, ok := cm.Data["pipeline.yaml"]
		if !ok {
			continue
		}
		found = true
		if err := yaml.Unmarshal([]byte(text), &pipe); err != nil {
			t.Fatalf("ConfigMap %s: %v", name, err)
		}
	}
	if !found || pipe.Model == "" || len(pipe.Stages) == 0 {
		t.Fatalf("no pipeline ConfigMap with a model and stages: %+v", pipe)
	}
	stages := map[string]bool{}
	for _, d := range o.deployments {
		ct := d.Spec.Template.Spec.Containers[0]
		if ct.Args[0] == "worker" {
			stages[flagValue(t, ct, "stage")] = true
		}
	}
	for _, s := range pipe.Stages {
		if !stages[s.Name] {
			t.Errorf("pipeline stage %s has no worker Deployment (workers: %v)", s.Name, stages)
		}
	}
}

// checkRules: the PrometheusRule's groups are deploy/prometheus/rules.yml's.
func checkRules(t *testing.T, name string, r *prometheusRule) {
	t.Helper()
	data, err := os.ReadFile("../prometheus/rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	var want struct {
		Groups []any `json:"groups"`
	}
	if err := yaml.Unmarshal(data, &want); err != nil {
		t.Fatal(err)
	}
	got, _ := json.Marshal(r.Spec.Groups)
	exp, _ := json.Marshal(want.Groups)
	if len(want.Groups) == 0 || !bytes.Equal(got, exp) {
		t.Errorf("PrometheusRule %s: groups differ from deploy/prometheus/rules.yml", name)
	}
}

func checkSelector(t *testing.T, what string, sel, labels map[string]string) {
	t.Helper()
	if len(sel) == 0 || !subset(sel, labels) {
		t.Errorf("%s: selector %v does not match its pod labels %v", what, sel, labels)
	}
}

func subset(sel, labels map[string]string) bool {
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// selected is the one workload whose pods sel matches.
// checkPodMonitor: a PodMonitor selects either the heads (job troupe-head,
// the job deploy/prometheus/rules.yml's alerts select) or every stage's
// workers (job troupe-worker, their --metrics-listen), on a port and path
// their pods serve /metrics on.
func checkPodMonitor(t *testing.T, name string, m *podMonitor, workloads map[string]corev1.PodTemplateSpec) {
	t.Helper()
	var match []corev1.PodTemplateSpec
	workers := 0
	for _, tmpl := range workloads {
		if tmpl.Labels["troupe.io/job"] == "troupe-worker" {
			workers++
		}
		if len(m.Spec.Selector.MatchLabels) > 0 && subset(m.Spec.Selector.MatchLabels, tmpl.Labels) {
			match = append(match, tmpl)
		}
	}
	if len(match) == 0 {
		t.Errorf("PodMonitor %s: selector matches no workload's pods", name)
		return
	}
	job := match[0].Labels[m.Spec.JobLabel]
	switch {
	case job == "troupe-head" && len(match) != 1:
		t.Errorf("PodMonitor %s: selects %d workloads, want the heads' only", name, len(match))
	case job == "troupe-worker" && len(match) != workers:
		t.Errorf("PodMonitor %s: selects %d workloads, want every stage's workers (%d)", name, len(match), workers)
	case job != "troupe-head" && job != "troupe-worker":
		t.Errorf("PodMonitor %s: job from label %q is %q, want troupe-head or troupe-worker", name, m.Spec.JobLabel, job)
	}
	for _, tmpl := range match {
		if got := tmpl.Labels[m.Spec.JobLabel]; got != job {
			t.Errorf("PodMonitor %s: selects pods of jobs %q and %q", name, job, got)
		}
		for _, e := range m.Spec.PodMetricsEndpoints {
			if !hasPort(tmpl.Spec.Containers, intstr.FromString(e.Port)) || e.Path != "/metrics" {
				t.Errorf("PodMonitor %s: endpoint %+v is not a /metrics port of its pods", name, e)
			}
		}
	}
}

func selected(workloads map[string]corev1.PodTemplateSpec, sel map[string]string) (corev1.PodTemplateSpec, bool) {
	var match []corev1.PodTemplateSpec
	for _, tmpl := range workloads {
		if len(sel) > 0 && subset(sel, tmpl.Labels) {
			match = append(match, tmpl)
		}
	}
	if len(match) != 1 {
		return corev1.PodTemplateSpec{}, false
	}
	return match[0], true
}

func hasPort(cts []corev1.Container, p intstr.IntOrString) bool {
	for _, ct := range cts {
		if containerPort(ct, p) != 0 {
			return true
		}
	}
	return false
}

// containerPort is the number of the container's port p (a name or a
// number), 0 if it has none.
func containerPort(ct corev1.Container, p intstr.IntOrString) int32 {
	for _, cp := range ct.Ports {
		if (p.Type == intstr.String && cp.Name == p.StrVal) || (p.Type == intstr.Int && cp.ContainerPort == p.IntVal) {
			return cp.ContainerPort
		}
	}
	return 0
}

func hasVolume(spec corev1.PodSpec, name string) bool {
	for _, v := range spec.Volumes {
		if v.Name == name {
			return true
		}
	}
	return false
}

func secretVolume(spec corev1.PodSpec, name string) string {
	for _, v := range spec.Volumes {
		if v.Name == name && v.Secret != nil {
			return v.Secret.SecretName
		}
	}
	return ""
}

func mounted(ct corev1.Container, path string) bool {
	for _, m := range ct.VolumeMounts {
		if strings.HasPrefix(path, strings.TrimSuffix(m.MountPath, "/")+"/") {
			return true
		}
	}
	return false
}

func envFromField(ct corev1.Container, name, field string) bool {
	for _, e := range ct.Env {
		if e.Name == name && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == field {
			return true
		}
	}
	return false
}

// flagValue is the value of --name=value in the container's args.
func flagValue(t *testing.T, ct corev1.Container, name string) string {
	t.Helper()
	for _, a := range ct.Args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v
		}
	}
	t.Fatalf("container %s: no --%s= in %v", ct.Name, name, ct.Args)
	return ""
}

// portOf is the port of an address or URL ending in :port.
func portOf(t *testing.T, what, addr string) int32 {
	t.Helper()
	i := strings.LastIndex(addr, ":")
	var p int32
	if _, err := fmt.Sscan(addr[i+1:], &p); err != nil || i < 0 {
		t.Fatalf("%s: no port in %q", what, addr)
	}
	return p
}

func duration(t *testing.T, what, s string) time.Duration {
	t.Helper()
	d, err := time.ParseDuration(s)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return d
}

// checkAutoscalers checks that every HorizontalPodAutoscaler and KEDA
// ScaledObject scales one stage's Deployment on that stage's
// troupe_stage_desired_replicas, that such a Deployment sets no replicas of
// its own, and that stages without one keep theirs.
func checkAutoscalers(t *testing.T, o *objects) {
	t.Helper()
	scaled := map[string]bool{}
	stageOf := func(what, target string) (string, bool) {
		d, ok := o.deployments[target]
		if !ok {
			t.Errorf("%s: target %s is no Deployment", what, target)
			return "", false
		}
		if d.Spec.Replicas != nil {
			t.Errorf("%s: Deployment %s sets replicas %d: it and the autoscaler would fight", what, target, *d.Spec.Replicas)
		}
		scaled[target] = true
		return d.Spec.Template.Labels["troupe.io/stage"], true
	}
	for name, h := range o.hpas {
		what := "HorizontalPodAutoscaler " + name
		if h.Spec.ScaleTargetRef.Kind != "Deployment" || h.Spec.ScaleTargetRef.APIVersion != "apps/v1" {
			t.Errorf("%s: target %+v is not an apps/v1 Deployment", what, h.Spec.ScaleTargetRef)
		}
		stage, ok := stageOf(what, h.Spec.ScaleTargetRef.Name)
		if !ok {
			continue
		}
		if h.Spec.MinReplicas == nil || *h.Spec.MinReplicas < 1 || *h.Spec.MinReplicas > h.Spec.MaxReplicas {
			t.Errorf("%s: replicas %v..%d", what, h.Spec.MinReplicas, h.Spec.MaxReplicas)
		}
		if len(h.Spec.Metrics) != 1 || h.Spec.Metrics[0].External == nil {
			t.Errorf("%s: want one External metric, got %+v", what, h.Spec.Metrics)
			continue
		}
		ext := h.Spec.Metrics[0].External
		if ext.Metric.Name != "troupe_stage_desired_replicas" || ext.Metric.Selector == nil || ext.Metric.Selector.MatchLabels["stage_name"] != stage {
			t.Errorf("%s: metric %+v, want troupe_stage_desired_replicas{stage_name=%q}", what, ext.Metric, stage)
		}
		if ext.Target.Type != autoscalingv2.AverageValueMetricType || ext.Target.AverageValue == nil || ext.Target.AverageValue.String() != "1" {
			t.Errorf("%s: target %+v, want an average value of 1 (replicas = the recommendation)", what, ext.Target)
		}
		checkBehavior(t, what, h.Spec.Behavior)
	}
	for name, so := range o.scaled {
		what := "ScaledObject " + name
		stage, ok := stageOf(what, so.Spec.ScaleTargetRef.Name)
		if !ok {
			continue
		}
		if so.Spec.MinReplicaCount < 1 || so.Spec.MinReplicaCount > so.Spec.MaxReplicaCount {
			t.Errorf("%s: replicas %d..%d", what, so.Spec.MinReplicaCount, so.Spec.MaxReplicaCount)
		}
		want := fmt.Sprintf("max(troupe_stage_desired_replicas{stage_name=%q})", stage)
		if len(so.Spec.Triggers) != 1 || so.Spec.Triggers[0].Type != "prometheus" || so.Spec.Triggers[0].Metadata.Query != want ||
			so.Spec.Triggers[0].Metadata.Threshold != "1" || so.Spec.Triggers[0].Metadata.ServerAddress == "" {
			t.Errorf("%s: triggers %+v, want one prometheus trigger %s, threshold 1", what, so.Spec.Triggers, want)
		}
		checkBehavior(t, what, &so.Spec.Advanced.HorizontalPodAutoscalerConfig.Behavior)
	}
	for name, d := range o.deployments {
		if stage := d.Spec.Template.Labels["troupe.io/stage"]; stage != "" && !scaled[name] && len(scaled) > 0 {
			t.Errorf("stage %s (Deployment %s) has no autoscaler while others have", stage, name)
		}
	}
}

// TestAutoscalers: the HPAs of values-autoscaling.yaml, the KEDA
// alternative, and neither by default; one per stage, with the bounds a
// stage overrides.
func TestAutoscalers(t *testing.T) {
	c := loadChart(t)
	for _, tc := range []struct {
		name      string
		file      string
		set       map[string]any
		hpa, keda int
	}{
		{"default", "", nil, 0, 0},
		{"hpa", "values-autoscaling.yaml", nil, 3, 0},
		{"keda", "values-autoscaling.yaml", map[string]any{"autoscaling.hpa.enabled": false, "autoscaling.keda.enabled": true,
			"autoscaling.keda.serverAddress": "http://prometheus:9090"}, 0, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := map[string]any{"clusterToken.value": testToken}
			for k, v := range tc.set {
				set[k] = v
			}
			rendered, err := render(c, values(t, tc.file, set))
			if err != nil {
				t.Fatal(err)
			}
			o := decodeAll(t, rendered)
			if len(o.hpas) != tc.hpa || len(o.scaled) != tc.keda {
				t.Fatalf("%d HorizontalPodAutoscalers and %d ScaledObjects, want %d and %d", len(o.hpas), len(o.scaled), tc.hpa, tc.keda)
			}
			checkObjects(t, o, false)
			bounds := map[string][2]int32{}
			for _, h := range o.hpas {
				bounds[h.Spec.ScaleTargetRef.Name] = [2]int32{*h.Spec.MinReplicas, h.Spec.MaxReplicas}
			}
			for _, so := range o.scaled {
				bounds[so.Spec.ScaleTargetRef.Name] = [2]int32{so.Spec.MinReplicaCount, so.Spec.MaxReplicaCount}
			}
			if tc.hpa+tc.keda > 0 {
				want := map[string][2]int32{"demo-troupe-thinker": {2, 8}, "demo-troupe-talker": {1, 8}, "demo-troupe-vocoder": {1, 16}}
				if fmt.Sprint(bounds) != fmt.Sprint(want) {
					t.Errorf("bounds %v, want %v (values-autoscaling.yaml)", bounds, want)
				}
			}
		})
	}
}
