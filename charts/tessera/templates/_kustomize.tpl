{{/*
The objects of manifests/, read through the chart's `manifests` link and built as kustomize
builds them, so that the chart and `kubectl apply -k` install one set of files. Only what those
kustomizations use is understood, and anything else there fails the render rather than being
left out: `resources` (files and directories), `configMapGenerator` (files, options.labels,
namespace; no name suffix), `patches` (JSON 6902 adding or replacing a label, by target group,
kind and name) and `labels` (pairs, put on each object's own labels, neither on selectors nor
on pod templates). As in kustomize, a kustomization's patches and labels apply to everything
beneath it, after those of the kustomizations it includes.

tessera.resource: (dict "files" .Files "path" P) -> YAML documents, each `---`-led.
*/}}
{{- define "tessera.resource" -}}
{{- if hasSuffix ".yaml" .path -}}
{{- $content := .files.Get .path -}}
{{- if not $content -}}
{{- fail (printf "%s: missing from the chart or empty" .path) -}}
{{- end }}
---
{{ $content }}
{{- else -}}
{{- $k := fromYaml (.files.Get (printf "%s/kustomization.yaml" .path)) -}}
{{- if not $k -}}
{{- fail (printf "%s/kustomization.yaml: missing from the chart or empty" .path) -}}
{{- end -}}
{{- $unknown := without (keys $k) "resources" "labels" "configMapGenerator" "patches" -}}
{{- if $unknown -}}
{{- fail (printf "%s/kustomization.yaml: the chart does not interpret %s" .path (join ", " (sortAlpha $unknown))) -}}
{{- end -}}
{{- $docs := "" -}}
{{- range $k.resources -}}
{{- $docs = print $docs "\n" (include "tessera.resource" (dict "files" $.files "path" (clean (printf "%s/%s" $.path .)))) -}}
{{- end -}}
{{- range $k.configMapGenerator -}}
{{- $data := dict -}}
{{- range .files -}}
{{- $_ := set $data (base .) ($.files.Get (clean (printf "%s/%s" $.path .))) -}}
{{- end -}}
{{- $meta := dict "name" .name "labels" ((.options).labels | default dict) -}}
{{- if .namespace -}}
{{- $_ := set $meta "namespace" .namespace -}}
{{- end -}}
{{- $docs = print $docs "\n---\n" (toYaml (dict "apiVersion" "v1" "kind" "ConfigMap" "metadata" $meta "data" $data)) -}}
{{- end -}}
{{- $labels := dict -}}
{{- range $k.labels -}}
{{- $labels = merge .pairs $labels -}}
{{- end -}}
{{- range regexSplit "(?m)^---[ \t]*$" $docs -1 -}}
{{- $obj := fromYaml . -}}
{{- if hasKey $obj "Error" -}}
{{- fail (printf "%s: %s" $.path $obj.Error) -}}
{{- end -}}
{{- if $obj -}}
{{- $meta := $obj.metadata -}}
{{- $group := ternary (first (splitList "/" $obj.apiVersion)) "" (contains "/" $obj.apiVersion) -}}
{{- range $k.patches -}}
{{- $t := .target | default dict -}}
{{- if and (or (not (hasKey $t "group")) (eq $t.group $group)) (or (not $t.kind) (eq $t.kind $obj.kind)) (or (not $t.name) (eq $t.name $meta.name)) -}}
{{- range fromYamlArray .patch -}}
{{- if not (and (has .op (list "add" "replace")) (hasPrefix "/metadata/labels/" .path)) -}}
{{- fail (printf "%s/kustomization.yaml: the chart interprets only patches that add or replace a label, not %s %s" $.path .op .path) -}}
{{- end -}}
{{- $key := trimPrefix "/metadata/labels/" .path | replace "~1" "/" | replace "~0" "~" -}}
{{- $_ := set $meta "labels" (merge (dict $key .value) ($meta.labels | default dict)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $_ := set $meta "labels" (merge (deepCopy $labels) ($meta.labels | default dict)) }}
---
{{ toYaml $obj }}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
