{{/* The labels Helm's own bookkeeping adds to every object; the only ones kustomize's build lacks. */}}
{{- define "tessera.helmLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
