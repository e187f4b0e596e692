package helm

import (
	"fmt"
	"path"
	"slices"
	"strings"
	"testing"

	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// What an operator's review of the chart asks, checked on every rendering
// by checkObjects: every container non-root with a pinned image, every
// claimed volume rendered, network policies that select real pods and
// ports, certificates that name what etcd advertises, autoscalers that
// wait before scaling down.

// checkBehavior: scale-up follows the figure at once, scale-down waits a
// window (not 0: a restarted head or a gap in the metric must not read as
// a drop).
func checkBehavior(t *testing.T, what string, b *autoscalingv2.HorizontalPodAutoscalerBehavior) {
	t.Helper()
	if b == nil || b.ScaleDown == nil || b.ScaleDown.StabilizationWindowSeconds == nil || *b.ScaleDown.StabilizationWindowSeconds < 1 {
		t.Errorf("%s: scale-down behaviour %+v, want a stabilization window of a second or more", what, b)
		return
	}
	if b.ScaleUp == nil || b.ScaleUp.StabilizationWindowSeconds == nil || *b.ScaleUp.StabilizationWindowSeconds != 0 {
		t.Errorf("%s: scale-up behaviour %+v, want no window", what, b.ScaleUp)
	}
}

// checkPodSecurity: every container of every pod, sidecars included, runs
// as a non-root user without privilege escalation, from an image with a
// pinned tag.
func checkPodSecurity(t *testing.T, workloads map[string]corev1.PodTemplateSpec) {
	t.Helper()
	for name, tmpl := range workloads {
		pod := tmpl.Spec.SecurityContext
		for _, ct := range tmpl.Spec.Containers {
			what := fmt.Sprintf("%s: container %s", name, ct.Name)
			sc := ct.SecurityContext
			nonRoot, user := (*bool)(nil), (*int64)(nil)
			if pod != nil {
				nonRoot, user = pod.RunAsNonRoot, pod.RunAsUser
			}
			if sc != nil && sc.RunAsNonRoot != nil {
				nonRoot = sc.RunAsNonRoot
			}
			if sc != nil && sc.RunAsUser != nil {
				user = sc.RunAsUser
			}
			if nonRoot == nil || !*nonRoot || user == nil || *user == 0 {
				t.Errorf("%s: runs as root or may (runAsNonRoot %v, runAsUser %v)", what, deref(nonRoot), deref(user))
			}
			if sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
				t.Errorf("%s: allowPrivilegeEscalation not false", what)
			}
			repo, tag, ok := strings.Cut(path.Base(ct.Image), ":")
			if !strings.Contains(ct.Image, "@sha256:") && (!ok || tag == "" || tag == "latest") {
				t.Errorf("%s: image %q (%s) has no pinned tag", what, ct.Image, repo)
			}
		}
	}
}

func deref[T any](p *T) any {
	if p == nil {
		return "unset"
	}
	return *p
}

// checkClaims: a pod volume from a PersistentVolumeClaim names one the
// chart rendered, which asks for storage.
func checkClaims(t *testing.T, o *objects, workloads map[string]corev1.PodTemplateSpec) {
	t.Helper()
	for name, tmpl := range workloads {
		for _, v := range tmpl.Spec.Volumes {
			if v.PersistentVolumeClaim == nil {
				continue
			}
			pvc, ok := o.pvcs[v.PersistentVolumeClaim.ClaimName]
			if !ok {
				t.Errorf("%s: volume %s claims %s, which the chart does not render", name, v.Name, v.PersistentVolumeClaim.ClaimName)
				continue
			}
			if s := pvc.Spec.Resources.Requests[corev1.ResourceStorage]; s.IsZero() || len(pvc.Spec.AccessModes) == 0 {
				t.Errorf("PersistentVolumeClaim %s: storage %s, access modes %v", pvc.Name, s.String(), pvc.Spec.AccessModes)
			}
		}
	}
}

// selects reports whether sel selects labels.
func selects(t *testing.T, sel *metav1.LabelSelector, l map[string]string) bool {
	t.Helper()
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		t.Fatalf("selector %+v: %v", sel, err)
	}
	return s.Matches(labels.Set(l))
}

// checkNetworkPolicies: every policy selects pods the chart runs, and every
// port it opens is a port of the pods it selects, every peer pod selector
// a selector of pods the chart runs.
func checkNetworkPolicies(t *testing.T, o *objects, workloads map[string]corev1.PodTemplateSpec) {
	t.Helper()
	for name, np := range o.netpols {
		var targets []corev1.PodTemplateSpec
		for _, tmpl := range workloads {
			if selects(t, &np.Spec.PodSelector, tmpl.Labels) {
				targets = append(targets, tmpl)
			}
		}
		if len(targets) == 0 {
			t.Errorf("NetworkPolicy %s selects no pod of the chart", name)
		}
		for _, rule := range np.Spec.Ingress {
			for _, p := range rule.Ports {
				for _, tmpl := range targets {
					if p.Port == nil || !hasPort(tmpl.Spec.Containers, *p.Port) {
						t.Errorf("NetworkPolicy %s: port %v is no port of pods %v", name, p.Port, tmpl.Labels)
					}
				}
			}
			for _, peer := range rule.From {
				if peer.PodSelector == nil || peer.NamespaceSelector != nil {
					continue // a peer of the operator's (metricsFrom)
				}
				n := 0
				for _, tmpl := range workloads {
					if selects(t, peer.PodSelector, tmpl.Labels) {
						n++
					}
				}
				if n == 0 {
					t.Errorf("NetworkPolicy %s: peer %+v selects no pod of the chart", name, peer.PodSelector)
				}
			}
		}
	}
}

// admitted reports whether the policies let a pod with labels from reach
// port (a name) of a pod with labels to. Only pod selectors are
// evaluated; a rule without peers admits everyone, as Kubernetes reads it.
// A pod no policy selects admits everything.
func admitted(t *testing.T, o *objects, to map[string]string, port string, from map[string]string) bool {
	t.Helper()
	selected := false
	for _, np := range o.netpols {
		if !selects(t, &np.Spec.PodSelector, to) {
			continue
		}
		selected = true
		for _, rule := range np.Spec.Ingress {
			portOK := len(rule.Ports) == 0 || slices.ContainsFunc(rule.Ports, func(p networkingv1.NetworkPolicyPort) bool {
				return p.Port != nil && p.Port.String() == port
			})
			if !portOK {
				continue
			}
			if len(rule.From) == 0 {
				return true
			}
			for _, peer := range rule.From {
				if peer.PodSelector != nil && peer.NamespaceSelector == nil && selects(t, peer.PodSelector, from) {
					return true
				}
			}
		}
	}
	return !selected
}

// checkCertificates: every Certificate has an issuer and a Secret a pod
// mounts; the server's names every host etcd advertises to its clients.
func checkCertificates(t *testing.T, o *objects, workloads map[string]corev1.PodTemplateSpec) {
	t.Helper()
	for name, c := range o.certs {
		if c.Spec.IssuerRef.Name == "" || c.Spec.SecretName == "" || len(c.Spec.Usages) == 0 {
			t.Errorf("Certificate %s: issuer %q, secret %q, usages %v", name, c.Spec.IssuerRef.Name, c.Spec.SecretName, c.Spec.Usages)
		}
		used := false
		for _, tmpl := range workloads {
			for _, v := range tmpl.Spec.Volumes {
				used = used || (v.Secret != nil && v.Secret.SecretName == c.Spec.SecretName)
			}
		}
		if !used {
			t.Errorf("Certificate %s: no pod mounts its Secret %s", name, c.Spec.SecretName)
		}
	}
	for sname, s := range o.statefulSets {
		ct := s.Spec.Template.Spec.Containers[0]
		adv := ""
		for _, a := range ct.Args {
			adv = strings.TrimPrefix(a, "--advertise-client-urls=")
			if adv != a {
				break
			}
			adv = ""
		}
		if !strings.HasPrefix(adv, "https://") {
			continue
		}
		var server *certificate
		for _, c := range o.certs {
			if slices.Contains(c.Spec.Usages, "server auth") {
				server = c
			}
		}
		if server == nil {
			continue // a Secret of the operator's
		}
		host := strings.Split(strings.TrimPrefix(adv, "https://"), ":")[0]
		host = strings.ReplaceAll(host, "$(POD_NAME)", sname+"-0")
		if !slices.ContainsFunc(server.Spec.DNSNames, func(n string) bool { return n == host || matchWildcard(n, host) }) {
			t.Errorf("StatefulSet %s advertises %s, which the server certificate's names %v do not cover", sname, host, server.Spec.DNSNames)
		}
		// The client Service is named as the StatefulSet.
		if !slices.Contains(server.Spec.DNSNames, sname) {
			t.Errorf("the server certificate does not name the client Service %s: %v", sname, server.Spec.DNSNames)
		}
	}
}

// matchWildcard matches *.rest against one label and rest.
func matchWildcard(pattern, host string) bool {
	rest, ok := strings.CutPrefix(pattern, "*.")
	if !ok {
		return false
	}
	first, after, ok := strings.Cut(host, ".")
	return ok && first != "" && after == rest
}

func renderObjects(t *testing.T, file string, set map[string]any) *objects {
	t.Helper()
	all := map[string]any{"clusterToken.value": testToken}
	for k, v := range set {
		all[k] = v
	}
	rendered, err := render(loadChart(t), values(t, file, all))
	if err != nil {
		t.Fatal(err)
	}
	return decodeAll(t, rendered)
}

// TestResourceDefaults: the defaults of values.yaml give head, worker and
// etcd containers the measured requests and a memory limit
// (docs/deploy.md, "Resources"); a stage's own replace the workers'.
func TestResourceDefaults(t *testing.T) {
	o := renderObjects(t, "", nil)
	checkObjects(t, o, false)
	want := map[string][3]string{ // cpu request, memory request, memory limit
		"demo-troupe-head":    {"250m", "128Mi", "1Gi"},
		"demo-troupe-thinker": {"100m", "64Mi", "256Mi"},
		"demo-troupe-etcd":    {"100m", "128Mi", "512Mi"},
	}
	containers := map[string]corev1.Container{}
	for n, d := range o.deployments {
		containers[n] = d.Spec.Template.Spec.Containers[0]
	}
	for n, s := range o.statefulSets {
		containers[n] = s.Spec.Template.Spec.Containers[0]
	}
	for n, w := range want {
		ct, ok := containers[n]
		if !ok {
			t.Fatalf("no workload %s", n)
		}
		r := ct.Resources
		got := [3]string{r.Requests.Cpu().String(), r.Requests.Memory().String(), r.Limits.Memory().String()}
		if got != w {
			t.Errorf("%s: resources %v, want %v", n, got, w)
		}
		if !r.Limits.Cpu().IsZero() {
			t.Errorf("%s: a CPU limit %s: throttling costs latency (and etcd its leases)", n, r.Limits.Cpu())
		}
	}
	vllm := renderObjects(t, "values-vllm.yaml", nil)
	if got := vllm.deployments["demo-troupe-thinker"].Spec.Template.Spec.Containers[0].Resources.Requests.Memory(); got.Cmp(resource.MustParse("256Mi")) != 0 {
		t.Errorf("a stage's own resources: memory request %s, want values-vllm.yaml's 256Mi", got)
	}
}

// TestVLLMSidecar: values-vllm.yaml's model server runs non-root (checked
// by checkPodSecurity with every rendering), from a pinned image, with its
// model files on a PersistentVolumeClaim the chart makes, mounted where
// HF_HOME points.
func TestVLLMSidecar(t *testing.T) {
	o := renderObjects(t, "values-vllm.yaml", nil)
	checkObjects(t, o, false)
	d := o.deployments["demo-troupe-thinker"]
	spec := d.Spec.Template.Spec
	var sidecar *corev1.Container
	for i := range spec.Containers {
		if spec.Containers[i].Name == "vllm" {
			sidecar = &spec.Containers[i]
		}
	}
	if sidecar == nil {
		t.Fatal("no vllm sidecar")
	}
	if strings.HasSuffix(sidecar.Image, ":latest") || !strings.Contains(sidecar.Image, ":v") {
		t.Errorf("image %s, want a pinned release tag", sidecar.Image)
	}
	claim := ""
	for _, v := range spec.Volumes {
		if v.Name == "model-cache" && v.PersistentVolumeClaim != nil {
			claim = v.PersistentVolumeClaim.ClaimName
		}
	}
	pvc, ok := o.pvcs[claim]
	if !ok {
		t.Fatalf("model-cache volume claims %q, not a rendered PersistentVolumeClaim (%v)", claim, o.pvcs)
	}
	if !slices.Contains(pvc.Spec.AccessModes, corev1.ReadWriteMany) || pvc.Annotations["helm.sh/resource-policy"] != "keep" {
		t.Errorf("PersistentVolumeClaim %s: access %v, annotations %v", claim, pvc.Spec.AccessModes, pvc.Annotations)
	}
	hf := ""
	for _, e := range sidecar.Env {
		if e.Name == "HF_HOME" {
			hf = e.Value
		}
	}
	if hf == "" || !mountedFrom(*sidecar, hf, "model-cache") {
		t.Errorf("HF_HOME=%q is not on the model cache", hf)
	}
	// An existing claim: the chart makes none and mounts it.
	o = renderObjects(t, "values-vllm.yaml", map[string]any{"stages": []any{map[string]any{
		"name": "thinker", "replicas": 1, "engine": "openai", "args": []any{"--upstream=http://127.0.0.1:8001/v1"},
		"modelCache": map[string]any{"existingClaim": "models"}}, map[string]any{"name": "speech", "replicas": 1, "engine": "openai-speech",
		"args": []any{"--upstream=http://tts:8091/v1"}}}})
	if len(o.pvcs) != 0 {
		t.Errorf("existingClaim: the chart still makes %v", o.pvcs)
	}
	if got := o.deployments["demo-troupe-thinker"].Spec.Template.Spec.Volumes; !slices.ContainsFunc(got, func(v corev1.Volume) bool {
		return v.PersistentVolumeClaim != nil && v.PersistentVolumeClaim.ClaimName == "models"
	}) {
		t.Errorf("existingClaim models is no volume: %v", got)
	}
}

func mountedFrom(ct corev1.Container, p, volume string) bool {
	for _, m := range ct.VolumeMounts {
		if m.Name == volume && strings.HasPrefix(p, strings.TrimSuffix(m.MountPath, "/")+"/") {
			return true
		}
	}
	return false
}

// TestNetworkPolicy: networkPolicy.enabled lets only the release's heads
// and workers reach etcd's client port, only etcd members its peer port,
// and only heads the workers' gRPC port; the workers' metrics port is open,
// or open to metricsFrom alone.
func TestNetworkPolicy(t *testing.T) {
	if o := renderObjects(t, "", nil); len(o.netpols) != 0 {
		t.Fatalf("off by default, got %d NetworkPolicies", len(o.netpols))
	}
	o := renderObjects(t, "", map[string]any{"networkPolicy.enabled": true, "etcd.replicas": 3})
	checkObjects(t, o, false)
	if len(o.netpols) != 2 {
		t.Fatalf("%d NetworkPolicies, want 2 (etcd, workers)", len(o.netpols))
	}
	head := o.deployments["demo-troupe-head"].Spec.Template.Labels
	thinker := o.deployments["demo-troupe-thinker"].Spec.Template.Labels
	vocoder := o.deployments["demo-troupe-vocoder"].Spec.Template.Labels
	etcd := o.statefulSets["demo-troupe-etcd"].Spec.Template.Labels
	other := map[string]string{"app": "something-else"}
	otherRelease := map[string]string{}
	for k, v := range thinker {
		otherRelease[k] = v
	}
	otherRelease["app.kubernetes.io/instance"] = "another"
	for _, c := range []struct {
		what     string
		to       map[string]string
		port     string
		from     map[string]string
		admitted bool
	}{
		{"head to etcd", etcd, "client", head, true},
		{"worker to etcd", etcd, "client", thinker, true},
		{"another stage's worker to etcd", etcd, "client", vocoder, true},
		{"another pod to etcd", etcd, "client", other, false},
		{"another release's worker to etcd", etcd, "client", otherRelease, false},
		{"etcd peer", etcd, "peer", etcd, true},
		{"head to etcd's peer port", etcd, "peer", head, false},
		{"head to a worker", thinker, "grpc", head, true},
		{"a worker to a worker", thinker, "grpc", vocoder, false},
		{"another pod to a worker", thinker, "grpc", other, false},
		{"another pod to a worker's metrics", thinker, "metrics", other, true},
		{"anyone to a head", head, "http", other, true},
	} {
		if got := admitted(t, o, c.to, c.port, c.from); got != c.admitted {
			t.Errorf("%s (port %s): admitted %v, want %v", c.what, c.port, got, c.admitted)
		}
	}
	mon := []any{map[string]any{"namespaceSelector": map[string]any{"matchLabels": map[string]any{"kubernetes.io/metadata.name": "monitoring"}}}}
	o = renderObjects(t, "", map[string]any{"networkPolicy.enabled": true, "networkPolicy.metricsFrom": mon})
	checkObjects(t, o, false)
	if admitted(t, o, thinker, "metrics", other) {
		t.Errorf("metricsFrom set: a pod of this namespace still reaches the workers' metrics")
	}
	ext := renderObjects(t, "", map[string]any{"networkPolicy.enabled": true, "etcd.external.endpoints": []any{"http://etcd:2379"}})
	if len(ext.netpols) != 1 {
		t.Errorf("external etcd: %d NetworkPolicies, want the workers' alone", len(ext.netpols))
	}
}

// TestEtcdTLS: etcd over TLS with certificates from cert-manager or from
// Secrets, with or without client certificates, the chart's etcd (one or
// three members) or an external one; and etcd's user and password from a
// Secret. etcd serves https with its certificate and, for mutual TLS,
// requires client certificates; every head and worker dials https with
// the CA and its own certificate, mounted from the client Secret.
func TestEtcdTLS(t *testing.T) {
	issuer := map[string]any{"name": "troupe-ca", "kind": "Issuer", "group": "cert-manager.io"}
	for _, tc := range []struct {
		name                    string
		set                     map[string]any
		mutual, external        bool
		serverSecret, clientSec string
		certs                   int
	}{
		{"cert-manager", map[string]any{"etcd.tls.enabled": true, "etcd.tls.certManager.enabled": true, "etcd.tls.certManager.issuerRef": issuer},
			true, false, "demo-troupe-etcd-server-tls", "demo-troupe-etcd-client-tls", 2},
		{"cert-manager, three members", map[string]any{"etcd.tls.enabled": true, "etcd.tls.certManager.enabled": true,
			"etcd.tls.certManager.issuerRef": issuer, "etcd.replicas": 3}, true, false, "demo-troupe-etcd-server-tls", "demo-troupe-etcd-client-tls", 2},
		{"secrets, server TLS only", map[string]any{"etcd.tls.enabled": true, "etcd.tls.serverSecret": "etcd-server",
			"etcd.tls.clientSecret": "etcd-ca", "etcd.tls.clientCertAuth": false}, false, false, "etcd-server", "etcd-ca", 0},
		{"external", map[string]any{"etcd.tls.enabled": true, "etcd.tls.clientSecret": "etcd-client",
			"etcd.external.endpoints": []any{"https://etcd-0.db:2379", "https://etcd-1.db:2379"}}, true, true, "", "etcd-client", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.set["etcd.auth.existingSecret"] = "etcd-login"
			o := renderObjects(t, "", tc.set)
			checkObjects(t, o, tc.external)
			if len(o.certs) != tc.certs {
				t.Errorf("%d Certificates, want %d", len(o.certs), tc.certs)
			}
			for name, s := range o.statefulSets {
				ct := s.Spec.Template.Spec.Containers[0]
				if l := flagValue(t, ct, "listen-client-urls"); !strings.HasPrefix(l, "https://") {
					t.Errorf("%s: --listen-client-urls=%s", name, l)
				}
				if got := secretVolume(s.Spec.Template.Spec, "etcd-server-tls"); got != tc.serverSecret {
					t.Errorf("%s: server certificate from Secret %q, want %q", name, got, tc.serverSecret)
				}
				if hasArg(ct, "--trusted-ca-file=") != tc.mutual {
					t.Errorf("%s: --trusted-ca-file given %v, want %v (client certificates required)", name, !tc.mutual, tc.mutual)
				}
			}
			for name, d := range o.deployments {
				ct := d.Spec.Template.Spec.Containers[0]
				if ep := flagValue(t, ct, "etcd-endpoints"); !strings.HasPrefix(ep, "https://") {
					t.Errorf("%s: --etcd-endpoints=%s", name, ep)
				}
				if !mounted(ct, flagValue(t, ct, "etcd-cacert")) {
					t.Errorf("%s: --etcd-cacert is in no mount", name)
				}
				if hasArg(ct, "--etcd-cert=") != tc.mutual || hasArg(ct, "--etcd-key=") != tc.mutual {
					t.Errorf("%s: client certificate flags %v, want them %v", name, ct.Args, tc.mutual)
				}
				if tc.mutual && (!mounted(ct, flagValue(t, ct, "etcd-cert")) || !mounted(ct, flagValue(t, ct, "etcd-key"))) {
					t.Errorf("%s: the client certificate is in no mount", name)
				}
				if got := secretVolume(d.Spec.Template.Spec, "etcd-tls"); got != tc.clientSec {
					t.Errorf("%s: client certificate from Secret %q, want %q", name, got, tc.clientSec)
				}
				for env, key := range map[string]string{"TROUPE_ETCD_USER": "username", "TROUPE_ETCD_PASSWORD": "password"} {
					if !slices.ContainsFunc(ct.Env, func(e corev1.EnvVar) bool {
						return e.Name == env && e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil &&
							e.ValueFrom.SecretKeyRef.Name == "etcd-login" && e.ValueFrom.SecretKeyRef.Key == key
					}) {
						t.Errorf("%s: no %s from Secret etcd-login key %s", name, env, key)
					}
				}
				if slices.ContainsFunc(ct.Args, func(a string) bool { return strings.Contains(a, "password") }) {
					t.Errorf("%s: etcd's password in the arguments: %v", name, ct.Args)
				}
			}
		})
	}
	// Without TLS nothing of it renders, and no password env either.
	o := renderObjects(t, "", nil)
	for name, d := range o.deployments {
		ct := d.Spec.Template.Spec.Containers[0]
		if hasArg(ct, "--etcd-cacert=") || hasVolume(d.Spec.Template.Spec, "etcd-tls") || slices.ContainsFunc(ct.Env, func(e corev1.EnvVar) bool { return e.Name == "TROUPE_ETCD_PASSWORD" }) {
			t.Errorf("%s: TLS or auth rendered while off", name)
		}
	}
}

func hasArg(ct corev1.Container, prefix string) bool {
	return slices.ContainsFunc(ct.Args, func(a string) bool { return strings.HasPrefix(a, prefix) })
}

// TestOperatorRefusals: values that would leave etcd's TLS half done, or
// the autoscaler without a scale-down window, fail the rendering.
func TestOperatorRefusals(t *testing.T) {
	c := loadChart(t)
	for _, tc := range []struct {
		name string
		set  map[string]any
		want string
	}{
		{"tls without certificates", map[string]any{"etcd.tls.enabled": true}, "etcd.tls.serverSecret"},
		{"tls without a client secret", map[string]any{"etcd.tls.enabled": true, "etcd.tls.serverSecret": "s"}, "etcd.tls.clientSecret"},
		{"cert-manager without an issuer", map[string]any{"etcd.tls.enabled": true, "etcd.tls.certManager.enabled": true}, "issuerRef.name"},
		{"tls to an http etcd", map[string]any{"etcd.tls.enabled": true, "etcd.tls.clientSecret": "c",
			"etcd.external.endpoints": []any{"http://etcd:2379"}}, "want https://"},
		{"no scale-down window", map[string]any{"autoscaling.hpa.enabled": true, "autoscaling.scaleDownStabilizationSeconds": 0}, "scaleDownStabilizationSeconds"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.set["clusterToken.value"] = testToken
			_, err := render(c, values(t, "", tc.set))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("render: %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
