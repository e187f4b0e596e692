{{/* The release's name prefix of every object, 52 characters at most so that suffixes stay within 63. */}}
{{- define "troupe.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "troupe.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "head"). */}}
{{- define "troupe.selectorLabels" -}}
app.kubernetes.io/name: {{ .ctx.Chart.Name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "troupe.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "troupe.tokenSecret" -}}
{{- if .Values.clusterToken.existingSecret -}}
{{ .Values.clusterToken.existingSecret }}
{{- else -}}
{{ include "troupe.fullname" . }}-cluster-token
{{- end -}}
{{- end -}}

{{/* etcd's client URLs, comma-separated: the external ones, or the chart's etcd Service. */}}
{{- define "troupe.etcdEndpoints" -}}
{{- if .Values.etcd.external.endpoints -}}
{{ join "," .Values.etcd.external.endpoints }}
{{- else -}}
{{ include "troupe.etcdScheme" . }}://{{ include "troupe.fullname" . }}-etcd:2379
{{- end -}}
{{- end -}}

{{- define "troupe.etcdScheme" -}}{{ if .Values.etcd.tls.enabled }}https{{ else }}http{{ end }}{{- end -}}

{{/* The Secrets of etcd's certificates: given, or cert-manager's. */}}
{{- define "troupe.etcdServerSecret" -}}
{{- .Values.etcd.tls.serverSecret | default (printf "%s-etcd-server-tls" (include "troupe.fullname" .)) -}}
{{- end -}}
{{- define "troupe.etcdClientSecret" -}}
{{- .Values.etcd.tls.clientSecret | default (printf "%s-etcd-client-tls" (include "troupe.fullname" .)) -}}
{{- end -}}

{{/* Whether heads and workers mount etcd's client Secret: its ca.crt verifies etcd, its tls.crt and tls.key are their certificate. */}}
{{- define "troupe.etcdClientCert" -}}
{{- if .Values.etcd.tls.enabled -}}true{{- end -}}
{{- end -}}

{{/* The etcd client flags of heads and workers, as args lines. */}}
{{- define "troupe.etcdClientArgs" -}}
- --etcd-endpoints={{ include "troupe.etcdEndpoints" . }}
{{- if include "troupe.etcdClientCert" . }}
- --etcd-cacert=/etc/troupe/etcd-tls/ca.crt
{{- if .Values.etcd.tls.clientCertAuth }}
- --etcd-cert=/etc/troupe/etcd-tls/tls.crt
- --etcd-key=/etc/troupe/etcd-tls/tls.key
{{- end }}
{{- end }}
{{- end -}}

{{/* etcd's user and password from a Secret, as env entries (the flags read TROUPE_ETCD_USER and TROUPE_ETCD_PASSWORD). */}}
{{- define "troupe.etcdAuthEnv" -}}
{{- with .Values.etcd.auth.existingSecret }}
- name: TROUPE_ETCD_USER
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.etcd.auth.usernameKey }}
- name: TROUPE_ETCD_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.etcd.auth.passwordKey }}
{{- end }}
{{- end -}}

{{- define "troupe.etcdClientMount" -}}
{{- if include "troupe.etcdClientCert" . }}
- name: etcd-tls
  mountPath: /etc/troupe/etcd-tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "troupe.etcdClientVolume" -}}
{{- if include "troupe.etcdClientCert" . }}
- name: etcd-tls
  secret:
    secretName: {{ include "troupe.etcdClientSecret" . }}
{{- end }}
{{- end -}}

{{- define "troupe.tokenPath" -}}/etc/troupe/cluster-token/{{ .Values.clusterToken.key }}{{- end -}}

{{/* Pod security of every troupe container: the image runs as 65532 from scratch. */}}
{{- define "troupe.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "troupe.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/*
Refuse values with a message: call with the message. helm install and
template stop at fail; helm lint does not (its lint mode turns fail into
an "[INFO] Fail: ..." log line and renders on, and would pass), so the
document it renders on with is no YAML: the lint reports an error and
exits 1.
*/}}
{{- define "troupe.fail" -}}
{{- fail . }}
troupe-chart-refuses: {{ . | quote }}
  - this document is not YAML on purpose, so that helm lint fails here
{{- end -}}

{{/* Refuse values that would render a broken cluster. */}}
{{- define "troupe.validate" -}}
{{- if and (not .Values.clusterToken.existingSecret) (lt (len .Values.clusterToken.value) 16) -}}
{{- include "troupe.fail" "clusterToken: set existingSecret, or value to 16 bytes at least (openssl rand -hex 32; docs/security.md)" -}}
{{- end -}}
{{- if and (not .Values.etcd.external.endpoints) (not (has (int .Values.etcd.replicas) (list 1 3))) -}}
{{- include "troupe.fail" "etcd.replicas: 1 or 3 members (a quorum of 2 tolerates one lost member); for another size, run etcd outside the chart and set etcd.external.endpoints" -}}
{{- end -}}
{{- if and (not .Values.etcd.external.endpoints) (eq (int .Values.etcd.replicas) 3) (not .Values.etcd.persistence.enabled) -}}
{{- include "troupe.fail" "etcd.replicas: 3 members need etcd.persistence.enabled: a member restarted with an empty data dir cannot rejoin its cluster" -}}
{{- end -}}
{{- $tls := .Values.etcd.tls -}}
{{- if and $tls.enabled (not .Values.etcd.external.endpoints) (not (or $tls.serverSecret $tls.certManager.enabled)) -}}
{{- include "troupe.fail" "etcd.tls.enabled: give etcd.tls.serverSecret (tls.crt, tls.key, ca.crt), or etcd.tls.certManager.enabled with an issuerRef" -}}
{{- end -}}
{{- if and $tls.enabled (not (or $tls.clientSecret $tls.certManager.enabled)) -}}
{{- include "troupe.fail" "etcd.tls.enabled: heads and workers need etcd.tls.clientSecret (ca.crt to verify etcd; tls.crt and tls.key with clientCertAuth), or etcd.tls.certManager.enabled" -}}
{{- end -}}
{{- if and $tls.certManager.enabled (not $tls.certManager.issuerRef.name) -}}
{{- include "troupe.fail" "etcd.tls.certManager.issuerRef.name: the cert-manager Issuer or ClusterIssuer that signs etcd's certificates" -}}
{{- end -}}
{{- range .Values.etcd.external.endpoints -}}
{{- if and $tls.enabled (not (hasPrefix "https://" .)) -}}
{{- include "troupe.fail" (printf "etcd.external.endpoints: %s with etcd.tls.enabled: want https://" .) -}}
{{- end -}}
{{- end -}}
{{- $names := list -}}
{{- range .Values.stages -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" .name) -}}
{{- include "troupe.fail" (printf "stages: name %q is not a DNS label (lowercase letters, digits, -)" .name) -}}
{{- end -}}
{{- if and .gpu (not .sidecars) -}}
{{- include "troupe.fail" (printf "stages: %s: gpu goes to the stage's first sidecar; it has none" .name) -}}
{{- end -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- range .Values.pipeline.stages -}}
{{- if not (has .name $names) -}}
{{- include "troupe.fail" (printf "pipeline: stage %q has no entry in stages (no worker would serve it)" .name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
