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
http://{{ include "troupe.fullname" . }}-etcd:2379
{{- end -}}
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

{{/* Refuse values that would render a broken cluster. */}}
{{- define "troupe.validate" -}}
{{- if and (not .Values.clusterToken.existingSecret) (lt (len .Values.clusterToken.value) 16) -}}
{{- fail "clusterToken: set existingSecret, or value to 16 bytes at least (openssl rand -hex 32; docs/security.md)" -}}
{{- end -}}
{{- if and (not .Values.etcd.external.endpoints) (not (has (int .Values.etcd.replicas) (list 1 3))) -}}
{{- fail "etcd.replicas: 1 or 3 members (a quorum of 2 tolerates one lost member); for another size, run etcd outside the chart and set etcd.external.endpoints" -}}
{{- end -}}
{{- if and (not .Values.etcd.external.endpoints) (eq (int .Values.etcd.replicas) 3) (not .Values.etcd.persistence.enabled) -}}
{{- fail "etcd.replicas: 3 members need etcd.persistence.enabled: a member restarted with an empty data dir cannot rejoin its cluster" -}}
{{- end -}}
{{- $names := list -}}
{{- range .Values.stages -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" .name) -}}
{{- fail (printf "stages: name %q is not a DNS label (lowercase letters, digits, -)" .name) -}}
{{- end -}}
{{- if and .gpu (not .sidecars) -}}
{{- fail (printf "stages: %s: gpu goes to the stage's first sidecar; it has none" .name) -}}
{{- end -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- range .Values.pipeline.stages -}}
{{- if not (has .name $names) -}}
{{- fail (printf "pipeline: stage %q has no entry in stages (no worker would serve it)" .name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
