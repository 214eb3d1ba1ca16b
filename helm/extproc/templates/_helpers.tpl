{{/* Names and labels. */}}
{{- define "extproc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "extproc.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "extproc.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Common labels; pass (dict "ctx" $ "component" "gateway"). */}}
{{- define "extproc.labels" -}}
helm.sh/chart: {{ include "extproc.chart" .ctx }}
{{ include "extproc.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: extproc
{{- end -}}

{{- define "extproc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "extproc.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "extproc.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "extproc.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
An image reference: [registry/]repository[:tag][@digest]. The registry is the image's own, else
global.imageRegistry (an umbrella chart's), else none; the tag defaults to .default; a digest
pins the image whatever the tag says. Call with (dict "image" ... "default" ... "global" ...).
*/}}
{{- define "extproc.image" -}}
{{- $registry := .image.registry | default ((.global | default dict).imageRegistry) | default "" -}}
{{- $ref := .image.repository -}}
{{- if $registry }}{{ $ref = printf "%s/%s" (trimSuffix "/" $registry) $ref }}{{ end -}}
{{- $tag := toString (.image.tag | default .default) -}}
{{- if $tag }}{{ $ref = printf "%s:%s" $ref $tag }}{{ end -}}
{{- if .image.digest }}{{ $ref = printf "%s@%s" $ref .image.digest }}{{ end -}}
{{- $ref -}}
{{- end -}}

{{/* Paths inside the gateway pod. */}}
{{- define "extproc.configPath" -}}/etc/extproc/config.yaml{{- end -}}
{{- define "extproc.envoyConfigPath" -}}/etc/envoy/envoy.yaml{{- end -}}
{{- define "extproc.scriptsPath" -}}/etc/gateway{{- end -}}
{{- define "extproc.redisPasswordPath" -}}/var/run/secrets/extproc/redis/password{{- end -}}

{{/* drain_grace_s as the sidecar reads it (config.py's default when unset). */}}
{{- define "extproc.drainGrace" -}}
{{- $cfg := .Values.config | default dict -}}
{{- if hasKey $cfg "drain_grace_s" -}}{{ $cfg.drain_grace_s }}{{- else -}}25{{- end -}}
{{- end -}}

{{/* Seconds from the start of termination until the sidecar has drained. */}}
{{- define "extproc.drainSeconds" -}}
{{- add (int .Values.extproc.preStopSleepSeconds) (int (ceil (include "extproc.drainGrace" . | float64))) -}}
{{- end -}}

{{/* Grace period: the drain plus 10 s for both processes to exit. */}}
{{- define "extproc.terminationGrace" -}}
{{- $min := add (int (include "extproc.drainSeconds" .)) 1 -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds -}}
{{- add $min 9 -}}
{{- else if lt (int .Values.terminationGracePeriodSeconds) $min -}}
{{- fail (printf "terminationGracePeriodSeconds: must be > extproc.preStopSleepSeconds + config.drain_grace_s (%d), or the kubelet kills the sidecar mid-drain (got %v)" (sub $min 1) .Values.terminationGracePeriodSeconds) -}}
{{- else -}}
{{- .Values.terminationGracePeriodSeconds -}}
{{- end -}}
{{- end -}}

{{/*
Gateway replicas. The in-process ledger (redis.mode none) counts one pod's requests against the
whole fleet's capacity, so N pods admit N times it: more than one needs the shared Redis ledger,
or allowPerPodLedger (the operator's word that each pod's pools describe its own share).
*/}}
{{- define "extproc.replicas" -}}
{{- $n := int .Values.replicaCount -}}
{{- if and (gt $n 1) (eq .Values.redis.mode "none") (not .Values.allowPerPodLedger) -}}
{{- fail (printf "replicaCount: must be 1 with the in-process ledger (redis.mode none): each gateway pod would admit the whole fleet's capacity by itself (%d pods: %dx over-admitted). Share one ledger with redis.mode bundled (or redis.mode external and redis.external.url), or set allowPerPodLedger true if each pod's config.pools describe its own share (got %d)" $n $n $n) -}}
{{- end -}}
{{- $n -}}
{{- end -}}

{{- define "extproc.redisName" -}}{{ include "extproc.fullname" . }}-redis{{- end -}}
{{- define "extproc.jaegerName" -}}{{ include "extproc.fullname" . }}-jaeger{{- end -}}
{{- define "extproc.scalerName" -}}{{ include "extproc.fullname" . }}-scaler{{- end -}}

{{- define "extproc.redisSecretName" -}}
{{- if eq .Values.redis.mode "external" -}}
{{- .Values.redis.external.existingSecret -}}
{{- else -}}
{{- .Values.redis.bundled.existingSecret | default (include "extproc.redisName" .) -}}
{{- end -}}
{{- end -}}

{{- define "extproc.redisSecretKey" -}}
{{- if eq .Values.redis.mode "external" -}}
{{- .Values.redis.external.existingSecretPasswordKey -}}
{{- else -}}
{{- .Values.redis.bundled.existingSecretPasswordKey -}}
{{- end -}}
{{- end -}}

{{- define "extproc.redisHasPassword" -}}
{{- if or (eq .Values.redis.mode "bundled") (and (eq .Values.redis.mode "external") .Values.redis.external.existingSecret) -}}true{{- end -}}
{{- end -}}

{{- define "extproc.tracingEndpoint" -}}
{{- if .Values.tracing.endpoint -}}
{{- .Values.tracing.endpoint -}}
{{- else if .Values.jaeger.enabled -}}
{{- printf "http://%s.%s.svc:4317" (include "extproc.jaegerName" .) .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/*
The sidecar's configuration file: .Values.config plus what the chart owns. Every check that
JSON Schema cannot express (cross-field rules) fails here with the field's name.
*/}}
{{- define "extproc.config" -}}
{{- $cfg := deepCopy (.Values.config | default dict) -}}
{{- range $key := list "listen" "metrics_listen" -}}
{{- if hasKey $cfg $key -}}
{{- fail (printf "config.%s: set by the chart from extproc.transport/grpcPort/metricsPort; remove it" $key) -}}
{{- end -}}
{{- end -}}
{{- if eq .Values.extproc.transport "unix" -}}
{{- $_ := set $cfg "listen" (printf "unix:%s" .Values.extproc.socketPath) -}}
{{- else -}}
{{- /* the pod network, for the kubelet's gRPC probes; Envoy dials it over loopback */ -}}
{{- $_ := set $cfg "listen" (printf "0.0.0.0:%d" (int .Values.extproc.grpcPort)) -}}
{{- end -}}
{{- $_ := set $cfg "metrics_listen" (printf "0.0.0.0:%d" (int .Values.extproc.metricsPort)) -}}
{{- $ledger := deepCopy ($cfg.ledger | default dict) -}}
{{- range $key := list "kind" "url" "username" "password" "password_file" "password_env" -}}
{{- if hasKey $ledger $key -}}
{{- fail (printf "config.ledger.%s: the chart sets the ledger's connection from redis.mode and redis.*; remove it" $key) -}}
{{- end -}}
{{- end -}}
{{- if eq .Values.redis.mode "bundled" -}}
{{- $_ := set $ledger "kind" "redis" -}}
{{- $_ := set $ledger "url" (printf "redis://%s:%d/0" (include "extproc.redisName" .) (int .Values.redis.bundled.port)) -}}
{{- $_ := set $ledger "password_file" (include "extproc.redisPasswordPath" .) -}}
{{- else if eq .Values.redis.mode "external" -}}
{{- if not .Values.redis.external.url -}}
{{- fail "redis.external.url: required with redis.mode external (redis://host:6379/0)" -}}
{{- end -}}
{{- $_ := set $ledger "kind" "redis" -}}
{{- $_ := set $ledger "url" .Values.redis.external.url -}}
{{- with .Values.redis.external.username -}}{{- $_ := set $ledger "username" . -}}{{- end -}}
{{- if .Values.redis.external.existingSecret -}}
{{- $_ := set $ledger "password_file" (include "extproc.redisPasswordPath" .) -}}
{{- end -}}
{{- end -}}
{{- if $ledger -}}{{- $_ := set $cfg "ledger" $ledger -}}{{- end -}}
{{- if .Values.tracing.enabled -}}
{{- if hasKey $cfg "tracing" -}}
{{- fail "config.tracing: set by the chart from tracing.*; remove it" -}}
{{- end -}}
{{- $endpoint := include "extproc.tracingEndpoint" . -}}
{{- if not $endpoint -}}
{{- fail "tracing.endpoint: required with tracing.enabled unless jaeger.enabled (then the bundled Jaeger is used)" -}}
{{- end -}}
{{- $_ := set $cfg "tracing" (dict "endpoint" $endpoint "sample_ratio" .Values.tracing.sampleRatio "service_name" .Values.tracing.serviceName) -}}
{{- end -}}
{{- if and (eq .Values.autoscaling.mode "keda") .Values.autoscaling.keda.writeListenKey -}}
{{- $_ := set $cfg "keda_listen" (printf "0.0.0.0:%d" (int .Values.autoscaling.keda.scalerPort)) -}}
{{- end -}}
{{- /* Helm replaces a list wholesale: `--set config.pools[0].replicas=3` leaves {replicas: 3}.
A nameless pools[0] is the chart's default pool: its name and models are filled in; the rest of
that pool in values.yaml is extproc's own defaults (tests/test_helm.py holds them equal). A
nameless later entry is refused rather than guessed at. */ -}}
{{- $pools := list -}}
{{- $names := list -}}
{{- range $i, $given := ($cfg.pools | default list) -}}
{{- $pool := $given -}}
{{- if not (hasKey $given "name") -}}
{{- if $i -}}
{{- fail (printf "config.pools[%d].name: required (only pools[0] may leave it out: it is then the chart's default pool, name default, models [\"*\"])" $i) -}}
{{- end -}}
{{- $pool = merge (deepCopy $given) (dict "name" "default" "models" (list "*")) -}}
{{- end -}}
{{- $pools = append $pools $pool -}}
{{- $names = append $names $pool.name -}}
{{- with $pool.tokenizer -}}
{{- if eq $.Values.tokenizer.source "none" -}}
{{- fail (printf "config.pools[%d].tokenizer: set tokenizer.source (pvc, hostPath, configMap or volume) so %s is mounted" $i .) -}}
{{- end -}}
{{- if not (hasPrefix (printf "%s/" (trimSuffix "/" $.Values.tokenizer.mountPath)) .) -}}
{{- fail (printf "config.pools[%d].tokenizer: must be a file under tokenizer.mountPath (%s) (got %s)" $i $.Values.tokenizer.mountPath .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if hasKey $cfg "pools" -}}{{- $_ := set $cfg "pools" $pools -}}{{- end -}}
{{- if and (ne .Values.autoscaling.mode "none") (not (has .Values.autoscaling.pool $names)) -}}
{{- fail (printf "autoscaling.pool: must name one of config.pools (%s) (got %s)" (join ", " $names) .Values.autoscaling.pool) -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* `extproc envoy-config` arguments: the init container runs exactly these. */}}
{{- define "extproc.envoyConfigArgs" -}}
- envoy-config
- --config
- {{ include "extproc.configPath" . }}
- --listen-address
- 0.0.0.0
- --port
- {{ .Values.envoy.port | quote }}
- --admin-port
- {{ .Values.envoy.adminPort | quote }}
- --backend
- {{ printf "%s:%d" .Values.backend.host (int .Values.backend.port) | quote }}
{{- if .Values.envoy.failClosed }}
- --fail-closed
{{- end }}
- --output
- {{ include "extproc.envoyConfigPath" . }}
{{- end -}}

{{/* Volume mounts the sidecar and the init container share (both load the config). */}}
{{- define "extproc.configMounts" -}}
- name: config
  mountPath: {{ dir (include "extproc.configPath" .) }}
  readOnly: true
{{- if ne .Values.tokenizer.source "none" }}
- name: tokenizer
  mountPath: {{ .Values.tokenizer.mountPath }}
  readOnly: true
  {{- with .Values.tokenizer.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- end }}
{{- if include "extproc.redisHasPassword" . }}
- name: redis-password
  mountPath: {{ dir (include "extproc.redisPasswordPath" .) }}
  readOnly: true
{{- end }}
{{- end -}}
