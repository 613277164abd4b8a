{{/* The labels Helm's own bookkeeping adds to every object; the only ones kustomize's build lacks. */}}
{{- define "tessera.helmLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/*
A workload's image reference: [<registry>/]<repository>@<digest> when the image names a digest,
else [<registry>/]<repository>:<image.tag, else the appVersion>.

tessera.image: (dict "root" $ "image" <workload>.image) -> the reference.
*/}}
{{- define "tessera.image" -}}
{{- $ref := .image.repository -}}
{{- with .root.Values.image.registry -}}
{{- $ref = printf "%s/%s" (trimSuffix "/" .) $ref -}}
{{- end -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $ref .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $ref (.root.Values.image.tag | default .root.Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/*
The pod spec fields a workload's values set: nodeSelector, tolerations, affinity and
priorityClassName where given (each replaces the manifest's), and imagePullSecrets as
{name: NAME} whether the values name them as strings or objects.

tessera.podFields: (dict "root" $ "workload" <workload values>) -> YAML of those fields.
*/}}
{{- define "tessera.podFields" -}}
{{- $fields := dict -}}
{{- range $field := list "nodeSelector" "tolerations" "affinity" "priorityClassName" -}}
{{- with get $.workload $field -}}
{{- $_ := set $fields $field . -}}
{{- end -}}
{{- end -}}
{{- $secrets := list -}}
{{- range .root.Values.imagePullSecrets -}}
{{- $secrets = append $secrets (ternary (dict "name" .) . (kindIs "string" .)) -}}
{{- end -}}
{{- if $secrets -}}
{{- $_ := set $fields "imagePullSecrets" $secrets -}}
{{- end -}}
{{- toYaml $fields -}}
{{- end -}}

{{/*
A container's `--FLAG=VALUE` arguments set in place: each flag given a non-empty value replaces
the argument of that flag, or is appended (in the flags' order by name) where the container has
none.

tessera.setFlags: (dict "container" CONTAINER "flags" (dict FLAG VALUE ...)) -> "".
*/}}
{{- define "tessera.setFlags" -}}
{{- $args := .container.args | default list -}}
{{- range $flag, $value := .flags -}}
{{- if ne (toString $value) "" -}}
{{- $arg := printf "--%s=%v" $flag $value -}}
{{- $out := list -}}
{{- $found := false -}}
{{- range $args -}}
{{- if hasPrefix (printf "--%s=" $flag) . -}}
{{- $out = append $out $arg -}}
{{- $found = true -}}
{{- else -}}
{{- $out = append $out . -}}
{{- end -}}
{{- end -}}
{{- if not $found -}}
{{- $out = append $out $arg -}}
{{- end -}}
{{- $args = $out -}}
{{- end -}}
{{- end -}}
{{- $_ := set .container "args" $args -}}
{{- end -}}
