{{- /*
Small pieces shared by several templates: names, labels, the ance containers' environment
(the ANCE_* contract with the Python services), volumes and mounts, credential references,
image and resources. No helper renders a whole object: each workload is written out in its
own template (trainer.yaml, inferencer.yaml, indexer.yaml, redis.yaml, minio.yaml).
*/}}

{{/* Chart name. */}}
{{- define "ance-train.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of every object: the release name, with the chart name unless it contains it. */}}
{{- define "ance-train.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "ance-train.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ance-train.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ance-train.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "ance-train.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector of the release's ance pods (trainer, inferencers, indexer). */}}
{{- define "ance-train.ancePodSelector" -}}
matchLabels:
  {{- include "ance-train.selectorLabels" . | nindent 2 }}
  ance-train.io/service: "true"
{{- end }}

{{- define "ance-train.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ance-train.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ance-train.secretName" -}}
{{- default (printf "%s-credentials" (include "ance-train.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{- define "ance-train.configMapName" -}}
{{- printf "%s-config" (include "ance-train.fullname" .) }}
{{- end }}

{{- define "ance-train.ancerunName" -}}
{{- include "ance-train.fullname" . }}
{{- end }}

{{/* Data-parallel trainer ranks: trainer.nodes pods × trainer.procsPerNode processes. */}}
{{- define "ance-train.trainerRanks" -}}
{{- mul (.Values.trainer.nodes | default 1 | int) (.Values.trainer.procsPerNode | default 1 | int) }}
{{- end }}

{{/* What torch.distributed.run needs to restart a group (--max-restarts): each new group's
rank 0 hosts a fresh rendezvous store instead of reusing the dead group's addresses
(pytorch/pytorch#135712). The embedded launcher sets the same: launcher/embedded.py RANKS_ENV. */}}
{{- define "ance-train.ranksEnv" -}}
- name: TORCH_DISABLE_SHARE_RDZV_TCP_STORE
  value: "1"
{{- end }}

{{/* The headless Service through which the trainer pods find pod 0, the rendezvous host. */}}
{{- define "ance-train.trainerRanksService" -}}
{{- printf "%s-ranks" (include "ance-train.fullname" .) }}
{{- end }}

{{- define "ance-train.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "ance-train.redisHost" -}}
{{- if .Values.redis.enabled }}
{{- printf "%s-redis" (include "ance-train.fullname" .) }}
{{- else }}
{{- required "externalRedis.host is required when redis.enabled is false" .Values.externalRedis.host }}
{{- end }}
{{- end }}

{{- define "ance-train.redisPort" -}}
{{- if .Values.redis.enabled }}6379{{ else }}{{ .Values.externalRedis.port | int }}{{ end }}
{{- end }}

{{- define "ance-train.redisUrl" -}}
{{- $db := ternary 0 (.Values.externalRedis.db | int) .Values.redis.enabled }}
{{- $scheme := ternary "rediss" "redis" .Values.tls.redis.enabled }}
{{- printf "%s://%s:%s/%d" $scheme (include "ance-train.redisHost" .) (include "ance-train.redisPort" .) $db }}
{{- end }}

{{/* Where the TLS Secrets are mounted (tls.*; every key of a kubernetes.io/tls Secret). */}}
{{- define "ance-train.tlsDir" -}}/etc/ance-tls{{- end }}

{{- define "ance-train.grpcServerName" -}}
{{- default (printf "%s-grpc" (include "ance-train.fullname" .)) .Values.tls.grpc.serverName }}
{{- end }}

{{/* The ACL rules of the services' Redis user: the run's keys and the commands the services
send. The same list as ance_train.infra.tls.redis_acl_rule (tests/test_helm_chart.py
compares the rendered rule with it): a command added there is added here. */}}
{{- define "ance-train.redisAclRules" -}}
{{- $commands := list "ping" "get" "set" "scan" "multi" "exec" "xadd" "xread" "xrange" "xrevrange" "xreadgroup" "xack" "xautoclaim" "xclaim" "xpending" "xgroup|create" "evalsha" "script|load" }}
{{- $rules := list "resetkeys" "resetchannels" "-@all" (printf "~ance:%s:*" .Values.run.id) }}
{{- range $commands }}{{ $rules = append $rules (printf "+%s" .) }}{{ end }}
{{- toJson $rules }}
{{- end }}

{{/* How kubelet probes an ance service: the native gRPC health probe, or with gRPC TLS (which
native probes cannot speak) the same health check run in the container. */}}
{{- define "ance-train.grpcProbe" -}}
{{- if .Values.tls.grpc.enabled }}
exec:
  command: ["python", "-m", "ance_train.infra.health_probe", "50051"]
{{- else }}
grpc:
  port: 50051
{{- end }}
{{- end }}

{{- define "ance-train.s3Endpoint" -}}
{{- if .Values.minio.enabled }}
{{- printf "%s-minio:9000" (include "ance-train.fullname" .) }}
{{- else }}
{{- required "externalS3.endpoint is required when minio.enabled is false" .Values.externalS3.endpoint }}
{{- end }}
{{- end }}

{{- define "ance-train.s3Port" -}}
{{- if .Values.minio.enabled }}9000
{{- else }}
{{- $parts := splitList ":" .Values.externalS3.endpoint }}
{{- if gt (len $parts) 1 }}{{ last $parts }}{{ else }}{{ ternary 443 80 .Values.externalS3.secure }}{{ end }}
{{- end }}
{{- end }}

{{/* A secretKeyRef into the credentials Secret; args: (list $ctx keyField). Never optional:
     in cluster mode the services refuse to start without every credential. */}}
{{- define "ance-train.secretRef" -}}
{{- $ctx := index . 0 -}}
secretKeyRef:
  name: {{ include "ance-train.secretName" $ctx }}
  key: {{ index $ctx.Values.auth.secretKeys (index . 1) }}
{{- end }}

{{/* The TLS settings of every ance container (tls.*; read by ance_train.infra.tls). */}}
{{- define "ance-train.tlsEnv" -}}
{{- $tlsDir := include "ance-train.tlsDir" . }}
{{- if .Values.tls.redis.enabled }}
- name: ANCE_REDIS_TLS_CA
  value: {{ printf "%s/redis/ca.crt" $tlsDir }}
{{- if .Values.tls.redis.clientSecretName }}
- name: ANCE_REDIS_TLS_CERT
  value: {{ printf "%s/redis-client/tls.crt" $tlsDir }}
- name: ANCE_REDIS_TLS_KEY
  value: {{ printf "%s/redis-client/tls.key" $tlsDir }}
{{- end }}
{{- end }}
{{- if .Values.tls.grpc.enabled }}
- name: ANCE_GRPC_TLS
  value: "1"
- name: ANCE_GRPC_TLS_CA
  value: {{ printf "%s/grpc/ca.crt" $tlsDir }}
- name: ANCE_GRPC_TLS_CERT
  value: {{ printf "%s/grpc/tls.crt" $tlsDir }}
- name: ANCE_GRPC_TLS_KEY
  value: {{ printf "%s/grpc/tls.key" $tlsDir }}
- name: ANCE_GRPC_TLS_MUTUAL
  value: {{ ternary "1" "0" .Values.tls.grpc.mutual | quote }}
- name: ANCE_GRPC_TLS_SERVER_NAME
  value: {{ include "ance-train.grpcServerName" . | quote }}
{{- end }}
{{- end }}

{{/* The pod's own address, name and namespace (the downward API), first in "ance-train.env". */}}
{{- define "ance-train.podFieldEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: ANCE_INSTANCE
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: ANCE_K8S_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- end }}

{{/* Environment of every ance container (the contract with services/: ANCE_*). */}}
{{- define "ance-train.env" -}}
{{ include "ance-train.podFieldEnv" . }}
- name: ANCE_CONFIG
  value: /etc/ance/config.yaml
- name: ANCE_REDIS_URL
  value: {{ include "ance-train.redisUrl" . | quote }}
- name: ANCE_REDIS_PASSWORD
  valueFrom:
    {{- include "ance-train.secretRef" (list . "redisPassword") | nindent 4 }}
{{- with .Values.auth.redisUsername }}
- name: ANCE_REDIS_USERNAME
  value: {{ . | quote }}
{{- end }}
{{- include "ance-train.tlsEnv" . }}
- name: ANCE_S3_ENDPOINT
  value: {{ include "ance-train.s3Endpoint" . | quote }}
- name: ANCE_S3_BUCKET
  value: {{ .Values.s3.bucket | quote }}
- name: ANCE_S3_SECURE
  value: {{ ternary "0" (ternary "1" "0" .Values.externalS3.secure) .Values.minio.enabled | quote }}
- name: ANCE_S3_ACCESS_KEY
  valueFrom:
    {{- include "ance-train.secretRef" (list . "s3AccessKey") | nindent 4 }}
- name: ANCE_S3_SECRET_KEY
  valueFrom:
    {{- include "ance-train.secretRef" (list . "s3SecretKey") | nindent 4 }}
- name: ANCE_WORK_DIR
  value: /work
- name: ANCE_GRPC_HOST
  value: 0.0.0.0
- name: ANCE_GRPC_PORT
  value: "50051"
- name: ANCE_ADVERTISE_ADDRESS
  value: $(POD_IP):50051
- name: ANCE_METRICS_PORT
  value: "9100"
- name: ANCE_CLUSTER_MODE
  value: "1"
{{- if .Values.anceRun.enabled }}
- name: ANCE_ANCERUN
  value: {{ include "ance-train.ancerunName" . | quote }}
{{- end }}
- name: HOME
  value: /tmp
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Mounts of every ance container (the pod's volumes are "ance-train.volumes"). */}}
{{- define "ance-train.volumeMounts" -}}
- name: config
  mountPath: /etc/ance
  readOnly: true
{{- if .Values.data.existingClaim }}
- name: data
  mountPath: /data
  readOnly: true
  {{- with .Values.data.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- end }}
- name: work
  mountPath: /work
- name: tmp
  mountPath: /tmp
{{- include "ance-train.tlsMounts" . }}
{{- end }}

{{/* The TLS Secrets' mounts / volumes in the ance pods (tls.*). */}}
{{- define "ance-train.tlsMounts" -}}
{{- $tlsDir := include "ance-train.tlsDir" . }}
{{- if .Values.tls.grpc.enabled }}
- name: tls-grpc
  mountPath: {{ $tlsDir }}/grpc
  readOnly: true
{{- end }}
{{- if .Values.tls.redis.enabled }}
- name: tls-redis
  mountPath: {{ $tlsDir }}/redis
  readOnly: true
{{- if .Values.tls.redis.clientSecretName }}
- name: tls-redis-client
  mountPath: {{ $tlsDir }}/redis-client
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{- define "ance-train.tlsVolumes" -}}
{{- if .Values.tls.grpc.enabled }}
- name: tls-grpc
  secret:
    secretName: {{ required "tls.grpc.secretName is required when tls.grpc.enabled" .Values.tls.grpc.secretName }}
    defaultMode: 0440
{{- end }}
{{- if .Values.tls.redis.enabled }}
- name: tls-redis
  secret:
    secretName: {{ required "tls.redis.secretName is required when tls.redis.enabled" .Values.tls.redis.secretName }}
    defaultMode: 0440
{{- with .Values.tls.redis.clientSecretName }}
- name: tls-redis-client
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- end }}
{{- end }}

{{/* Volumes of every ance pod: the run config, the dataset (read-only; none when
data.existingClaim is empty: the dataset is then in a bucket, run.config.data.path
s3://bucket/prefix/), scratch space. */}}
{{- define "ance-train.volumes" -}}
{{- $dataPath := toString (dig "data" "path" "" .Values.run.config) }}
{{- if not (or .Values.data.existingClaim (hasPrefix "s3://" $dataPath)) }}
{{- fail (printf "data.existingClaim is empty but run.config.data.path is %q: name the dataset's volume claim, or put the dataset in a bucket (run.config.data.path: s3://bucket/prefix/)" $dataPath) }}
{{- end }}
- name: config
  configMap:
    name: {{ include "ance-train.configMapName" . }}
{{- if .Values.data.existingClaim }}
- name: data
  persistentVolumeClaim:
    claimName: {{ .Values.data.existingClaim }}
    readOnly: true
{{- end }}
- name: work
  emptyDir:
    {{- with .Values.workDir.medium }}
    medium: {{ . }}
    {{- end }}
    {{- with .Values.workDir.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
- name: tmp
  emptyDir:
    {{- with .Values.tmpDir.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- include "ance-train.tlsVolumes" . }}
{{- end }}

{{/* requests/limits with the role's GPUs added to both; args: (list $ctx resources gpus). */}}
{{- define "ance-train.resources" -}}
{{- $ctx := index . 0 -}}
{{- $res := deepCopy (index . 1 | default dict) }}
{{- $gpus := index . 2 | int }}
{{- if gt $gpus 0 }}
{{- $_ := set $res "requests" (merge (dict $ctx.Values.gpuResourceName $gpus) ($res.requests | default dict)) }}
{{- $_ := set $res "limits" (merge (dict $ctx.Values.gpuResourceName $gpus) ($res.limits | default dict)) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* NetworkPolicy egress rule: DNS to any resolver. */}}
{{- define "ance-train.dnsEgress" -}}
- ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
{{- end }}

{{/* A pod's nodeSelector, tolerations and affinity: the role's own when set, else the
chart-wide defaults (top-level nodeSelector / tolerations / affinity); each field on its own.
args: (list $ctx roleValues). */}}
{{- define "ance-train.scheduling" -}}
{{- $ctx := index . 0 }}
{{- $role := index . 1 | default dict }}
{{- range $field := list "nodeSelector" "tolerations" "affinity" }}
{{- with (get $role $field | default (index $ctx.Values $field)) }}
{{ $field }}:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end }}

{{/* The inferencers' work queue in Redis: the stream and its consumer group, as the services
name them (ance_train.protocol.keys.redis_key(run_id, ShardWork.TYPE) and
ance_train.infra.bus.WorkQueue.GROUP; tests/test_helm_keda.py compares them). */}}
{{- define "ance-train.workStream" -}}
{{- printf "ance:%s:work" .Values.run.id }}
{{- end }}

{{- define "ance-train.workGroup" -}}inferencers{{- end }}

{{/* Whether the inferencer Deployment leaves spec.replicas to someone else: KEDA
(inferencer.keda.enabled) or the operator (inferencer.replicas: null, for kubectl scale). */}}
{{- define "ance-train.inferencerReplicasUnset" -}}
{{- if or .Values.inferencer.keda.enabled (kindIs "invalid" .Values.inferencer.replicas) }}true{{ end }}
{{- end }}

{{/* The prepare step's access to the Hugging Face Hub: model.path may name a Hub id, which
prepare (only) downloads into the run's store, every role then loading that copy
(docs/models.md). The image is offline by default; HF_HOME on the work volume, not /tmp. */}}
{{- define "ance-train.hubEnv" -}}
- name: HF_HUB_OFFLINE
  value: "0"
- name: TRANSFORMERS_OFFLINE
  value: "0"
- name: HF_HOME
  value: /work/huggingface
{{- with .Values.hub.endpoint }}
- name: HF_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- with .Values.hub.tokenSecret }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.hub.tokenKey }}
{{- end }}
{{- end }}
