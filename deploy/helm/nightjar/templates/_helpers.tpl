{{/* Names: the release name, or release-chart when the release name lacks "nightjar". */}}
{{- define "nightjar.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "nightjar.selectorLabels" -}}
app.kubernetes.io/name: vllm
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "nightjar.labels" -}}
{{ include "nightjar.selectorLabels" . }}
app.kubernetes.io/part-of: nightjar
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "nightjar.adminTokenSecret" -}}
{{- .Values.adminToken.existingSecret | default (printf "%s-admin-token" (include "nightjar.fullname" .)) -}}
{{- end -}}

{{- define "nightjar.healthProbe" -}}
exec:
  command: [nightjarctl, --target, unix:/run/nightjar/nightjar.sock, --timeout, "2", health]
{{- end -}}

{{- define "nightjar.engineProbe" -}}
httpGet: {path: /health, port: http}
{{- end -}}

{{/* An image reference: repository@digest when a digest is given, else repository:tag. */}}
{{- define "nightjar.image" -}}
{{- if .digest -}}
{{- printf "%s@%s" .repository .digest -}}
{{- else -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}
{{- end -}}

{{/* The pod's labels: podLabels, then the chart's labels over them (the selector labels
     cannot be overridden, or the Services and the StatefulSet would lose their pods). */}}
{{- define "nightjar.podLabels" -}}
{{- $chart := include "nightjar.labels" . | fromYaml -}}
{{- toYaml (merge $chart (deepCopy .Values.podLabels)) -}}
{{- end -}}

{{/* "true" when the sidecar has a configuration ConfigMap (sidecar.config or configFiles). */}}
{{- define "nightjar.hasConfig" -}}
{{- if or .Values.sidecar.config .Values.sidecar.configFiles -}}true{{- end -}}
{{- end -}}

{{/* podAnnotations, and a checksum of the sidecar's configuration, so that a changed
     configuration rolls the pods (a mounted ConfigMap alone would not restart them). */}}
{{- define "nightjar.podAnnotations" -}}
{{- $annotations := deepCopy .Values.podAnnotations -}}
{{- if include "nightjar.hasConfig" . -}}
{{- $_ := set $annotations "checksum/sidecar-config" (include (print $.Template.BasePath "/sidecar-config.yaml") . | sha256sum) -}}
{{- end -}}
{{- with $annotations }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* Fleet learning's Redis URL: sidecar.fleet.url, else the chart's own Redis when
     redis.enabled, else "" (off). */}}
{{- define "nightjar.fleetUrl" -}}
{{- if .Values.sidecar.fleet.url -}}
{{- .Values.sidecar.fleet.url -}}
{{- else if .Values.redis.enabled -}}
{{- printf "redis://%s-redis:6379/0" (include "nightjar.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The fleet's deployment name: sidecar.fleet.deployment, else <namespace>.<fullname>
     (releases of one name in two namespaces do not pool). */}}
{{- define "nightjar.fleetDeployment" -}}
{{- .Values.sidecar.fleet.deployment | default (printf "%s.%s" .Release.Namespace (include "nightjar.fullname" .)) -}}
{{- end -}}
