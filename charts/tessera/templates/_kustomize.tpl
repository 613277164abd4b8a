{{/*
The objects of manifests/, read through the chart's `manifests` link and built as kustomize
builds them, so that the chart and `kubectl apply -k` install one set of files. Only what those
kustomizations use is understood, and anything else there fails the render rather than being
left out: `resources` (files and directories), `configMapGenerator` (files, options.labels,
namespace; no name suffix), `patches` (inline JSON 6902 ops test, replace and add, by target
group, kind and name) and `labels` (pairs, put on each object's own labels, neither on selectors
nor on pod templates). As in kustomize, a kustomization's patches and labels apply to everything
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
{{- $where := printf "%s/kustomization.yaml" .path -}}
{{- $k := fromYaml (.files.Get $where) -}}
{{- if not $k -}}
{{- fail (printf "%s: missing from the chart or empty" $where) -}}
{{- end -}}
{{- $unknown := without (keys $k) "resources" "labels" "configMapGenerator" "patches" -}}
{{- if $unknown -}}
{{- fail (printf "%s: the chart does not interpret %s" $where (join ", " (sortAlpha $unknown))) -}}
{{- end -}}
{{- $docs := "" -}}
{{- range $k.resources -}}
{{- $docs = print $docs "\n" (include "tessera.resource" (dict "files" $.files "path" (clean (printf "%s/%s" $.path .)))) -}}
{{- end -}}
{{- range $k.configMapGenerator -}}
{{- if or (without (keys .) "name" "namespace" "files" "options") (without (keys (.options | default dict)) "labels" "disableNameSuffixHash") (not (.options).disableNameSuffixHash) -}}
{{- fail (printf "%s: configMapGenerator %s: the chart interprets only name, namespace, files, options.labels and options.disableNameSuffixHash: true" $where .name) -}}
{{- end -}}
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
{{- if without (keys .) "pairs" -}}
{{- fail (printf "%s: the chart interprets only the pairs of labels, not %s" $where (join ", " (sortAlpha (without (keys .) "pairs")))) -}}
{{- end -}}
{{- $labels = merge .pairs $labels -}}
{{- end -}}
{{- range $k.patches -}}
{{- if or (without (keys .) "target" "patch") (without (keys (.target | default dict)) "group" "kind" "name") -}}
{{- fail (printf "%s: the chart interprets only patches given inline with a target of group, kind and name" $where) -}}
{{- end -}}
{{- end -}}
{{- range regexSplit "(?m)^---[ \t]*$" $docs -1 -}}
{{- $obj := fromYaml . -}}
{{- if hasKey $obj "Error" -}}
{{- fail (printf "%s: %s" $.path $obj.Error) -}}
{{- end -}}
{{- if $obj -}}
{{- $group := ternary (first (splitList "/" $obj.apiVersion)) "" (contains "/" $obj.apiVersion) -}}
{{- range $k.patches -}}
{{- $t := .target | default dict -}}
{{- if and (or (not (hasKey $t "group")) (eq $t.group $group)) (or (not $t.kind) (eq $t.kind $obj.kind)) (or (not $t.name) (eq $t.name $obj.metadata.name)) -}}
{{- range fromYamlArray .patch -}}
{{- include "tessera.jsonPatch" (dict "obj" $obj "op" . "where" (printf "%s, %s/%s" $where $obj.kind $obj.metadata.name)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $meta := $obj.metadata -}}
{{- $_ := set $meta "labels" (merge (deepCopy $labels) ($meta.labels | default dict)) }}
---
{{ toYaml $obj }}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
One JSON 6902 operation (RFC 6902) applied to a parsed object in place, as kustomize applies it:
`test` (the value at the path equals the given one, else the render fails), `replace` (of an
existing member or element) and `add` (a member; an element before an index, or `-` to append).
The path's tokens are object keys (`~1` for `/`, `~0` for `~`) or array indices. An array is
replaced whole in the object that holds it, so an array directly inside an array fails.

tessera.jsonPatch: (dict "obj" OBJECT "op" OPERATION "where" "FILE, KIND/NAME") -> "".
*/}}
{{- define "tessera.jsonPatch" -}}
{{- $op := .op -}}
{{- $where := .where -}}
{{- if not (kindIs "map" $op) -}}
{{- fail (printf "%s: the chart interprets only JSON 6902 patches (a list of operations)" $where) -}}
{{- end -}}
{{- if not (has $op.op (list "test" "replace" "add")) -}}
{{- fail (printf "%s: the chart interprets the JSON 6902 operations test, replace and add, not %s" $where (toJson $op.op)) -}}
{{- end -}}
{{- if not (and (hasPrefix "/" ($op.path | toString)) (hasKey $op "value")) -}}
{{- fail (printf "%s: %s needs a path below the root and a value: %s" $where $op.op (toJson $op)) -}}
{{- end -}}
{{- $tokens := list -}}
{{- range rest (splitList "/" $op.path) -}}
{{- $tokens = append $tokens (. | replace "~1" "/" | replace "~0" "~") -}}
{{- end -}}
{{- $parent := .obj -}}
{{- $holder := dict -}}
{{- $held := "" -}}
{{- $missing := printf "%s: %s %s: no such location" $where $op.op $op.path -}}
{{- range initial $tokens -}}
{{- $next := "" -}}
{{- if and (kindIs "map" $parent) (hasKey $parent .) -}}
{{- $next = get $parent . -}}
{{- else if and (kindIs "slice" $parent) (regexMatch "^(0|[1-9][0-9]*)$" .) (lt (atoi .) (len $parent)) -}}
{{- $next = index $parent (atoi .) -}}
{{- else -}}
{{- fail $missing -}}
{{- end -}}
{{- $holder = $parent -}}
{{- $held = . -}}
{{- $parent = $next -}}
{{- end -}}
{{- $last := last $tokens -}}
{{- if kindIs "map" $parent -}}
{{- if and (ne $op.op "add") (not (hasKey $parent $last)) -}}
{{- fail $missing -}}
{{- end -}}
{{- if eq $op.op "test" -}}
{{- if ne (toJson (get $parent $last)) (toJson $op.value) -}}
{{- fail (printf "%s: test %s: %s, not %s" $where $op.path (toJson (get $parent $last)) (toJson $op.value)) -}}
{{- end -}}
{{- else -}}
{{- $_ := set $parent $last $op.value -}}
{{- end -}}
{{- else if kindIs "slice" $parent -}}
{{- $size := len $parent -}}
{{- $at := $size -}}
{{- if regexMatch "^(0|[1-9][0-9]*)$" $last -}}
{{- $at = atoi $last -}}
{{- else if or (ne $last "-") (ne $op.op "add") -}}
{{- fail $missing -}}
{{- end -}}
{{- if or (gt $at $size) (and (ne $op.op "add") (eq $at $size)) -}}
{{- fail $missing -}}
{{- end -}}
{{- if eq $op.op "test" -}}
{{- if ne (toJson (index $parent $at)) (toJson $op.value) -}}
{{- fail (printf "%s: test %s: %s, not %s" $where $op.path (toJson (index $parent $at)) (toJson $op.value)) -}}
{{- end -}}
{{- else -}}
{{- if not (kindIs "map" $holder) -}}
{{- fail (printf "%s: %s %s: the chart does not patch an array inside an array" $where $op.op $op.path) -}}
{{- end -}}
{{- $after := ternary $at (add1 $at) (eq $op.op "add") -}}
{{- $_ := set $holder $held (concat (slice $parent 0 $at) (list $op.value) (slice $parent $after)) -}}
{{- end -}}
{{- else -}}
{{- fail $missing -}}
{{- end -}}
{{- end -}}
