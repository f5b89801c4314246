{{- /*
The trainer's pod template (metadata and spec), written once: the Job (trainer.yaml) and the
Kubeflow PyTorchJob's Master and Worker replicas (trainer-pytorchjob.yaml) both render it.
Argument: (dict "ctx" $ "kubeflow" true|false). What differs between the two, and only that:

- the Job's pod: restartPolicy Never, the headless Service's subdomain, the container `trainer`
  and, with ranks, torchrun's rendezvous flags and the `rdzv` port;
- the PyTorchJob's pod: the container `pytorch` (the operator requires the name), torchrun
  without rendezvous flags (the operator passes them as PET_* variables), the operator's port
  `pytorchjob-port`; restartPolicy is set per replica by trainer-pytorchjob.yaml.

Everything else (the `prepare` init container, environment, NCCL_* passthrough, GPUs,
/dev/shm, probes, volumes, security context, scheduling) is the same in both by construction
(tests/test_helm_chart.py compares them).
*/}}
{{- define "ance-train.trainerPod" -}}
{{- $kubeflow := .kubeflow }}
{{- with .ctx }}
{{- $ranks := include "ance-train.trainerRanks" . | int }}
{{- $nodes := .Values.trainer.nodes | default 1 | int }}
{{- $procs := .Values.trainer.procsPerNode | default 1 | int }}
{{- $job := printf "%s-trainer" (include "ance-train.fullname" .) }}
metadata:
  labels:
    {{- include "ance-train.selectorLabels" . | nindent 4 }}
    app.kubernetes.io/component: trainer
    ance-train.io/service: "true"
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    {{- /* A changed run config changes the pod template, which a Job cannot
           change in place: an upgrade then needs the Job deleted first. */}}
    checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- if not $kubeflow }}
  restartPolicy: Never
  {{- if gt $ranks 1 }}
  subdomain: {{ include "ance-train.trainerRanksService" . }}
  {{- end }}
  {{- end }}
  serviceAccountName: {{ include "ance-train.serviceAccountName" . }}
  automountServiceAccountToken: true
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  initContainers:
    {{- include "ance-train.waitForData" . | nindent 4 }}
    # Validates the dataset and publishes its index to the object store.
    - name: prepare
      image: {{ include "ance-train.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args: ["prepare"]
      env:
        {{- include "ance-train.env" . | nindent 8 }}
        {{- include "ance-train.hubEnv" . | nindent 8 }}
      volumeMounts:
        {{- include "ance-train.volumeMounts" . | nindent 8 }}
      resources:
        {{- toYaml .Values.trainer.prepare.resources | nindent 8 }}
      securityContext:
        {{- toYaml .Values.containerSecurityContext | nindent 8 }}
  containers:
    - name: {{ ternary "pytorch" "trainer" $kubeflow }}
      image: {{ include "ance-train.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      {{- if $kubeflow }}
      # The rendezvous flags come from the operator's PET_* variables.
      command:
        - python
        - -m
        - torch.distributed.run
        - -m
        - ance_train.cli
      {{- else if gt $ranks 1 }}
      command:
        - python
        - -m
        - torch.distributed.run
        - --nnodes
        - {{ $nodes | quote }}
        - --nproc-per-node
        - {{ $procs | quote }}
        - --node-rank
        - $(JOB_COMPLETION_INDEX)
        - --rdzv-backend
        - c10d
        - --rdzv-endpoint
        - {{ printf "%s-0.%s:29400" $job (include "ance-train.trainerRanksService" .) }}
        - --rdzv-id
        - {{ .Release.Name }}
        - --max-restarts
        - {{ .Values.trainer.maxRestarts | default 0 | int | quote }}
        - --rdzv-conf
        - {{ printf "join_timeout=%d" (.Values.trainer.rdzvJoinTimeout | int) }}
        - -m
        - ance_train.cli
      {{- end }}
      args: ["serve", "trainer"]
      ports:
        - name: grpc
          containerPort: 50051
          protocol: TCP
        - name: metrics
          containerPort: 9100
          protocol: TCP
        {{- if $kubeflow }}
        # The operator's port name: MASTER_PORT and the pods' Services; the c10d
        # rendezvous listens on it in the rendezvous host pod.
        - name: pytorchjob-port
          containerPort: 29400
          protocol: TCP
        {{- else if gt $ranks 1 }}
        - name: rdzv
          containerPort: 29400
          protocol: TCP
        {{- end }}
      env:
        {{- include "ance-train.env" . | nindent 8 }}
        {{- if or $kubeflow (gt $ranks 1) }}
        {{- include "ance-train.ranksEnv" . | nindent 8 }}
        {{- end }}
        {{- range $name, $value := .Values.trainer.ncclEnv }}
        - name: {{ $name }}
          value: {{ $value | toString | quote }}
        {{- end }}
      volumeMounts:
        {{- include "ance-train.volumeMounts" . | nindent 8 }}
        {{- if gt $ranks 1 }}
        - name: dshm
          mountPath: /dev/shm
        {{- end }}
      {{- if le $nodes 1 }}
      startupProbe:
        {{- include "ance-train.grpcProbe" . | nindent 8 }}
        {{- toYaml .Values.probes.startup | nindent 8 }}
      readinessProbe:
        {{- include "ance-train.grpcProbe" . | nindent 8 }}
        {{- toYaml .Values.probes.readiness | nindent 8 }}
      livenessProbe:
        {{- include "ance-train.grpcProbe" . | nindent 8 }}
        {{- toYaml .Values.probes.liveness | nindent 8 }}
      {{- end }}
      resources:
        {{- include "ance-train.resources" (list . .Values.trainer.resources .Values.trainer.gpus) | nindent 8 }}
      securityContext:
        {{- toYaml .Values.containerSecurityContext | nindent 8 }}
  volumes:
    {{- include "ance-train.volumes" . | nindent 4 }}
    {{- if gt $ranks 1 }}
    # NCCL's shared-memory transport and DataLoader workers (the runtime's /dev/shm is 64M).
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ .Values.trainer.shmSize }}
    {{- end }}
  {{- include "ance-train.scheduling" (list . .Values.trainer) | nindent 2 }}
{{- end }}
{{- end }}

{{- /*
With the dataset in a bucket (run.config.data.path s3://…) and data.waitSeconds > 0, the
trainer pod first waits for it: the upload (docs/deployment.md, section 2) usually comes after
the install, since the release's MinIO exists only then. It polls, with the run's S3
settings, for the files `ance-train prepare` reads (data.formats.DatasetFiles.resolve: the
bucket, corpus, queries and train qrels), every 15 s, up to data.waitSeconds; then `prepare`
validates them. Without the wait, prepare would fail at once and the Job's retries
(backoffLimit) would be spent before the upload is done.
*/}}
{{- define "ance-train.waitForData" -}}
{{- $path := toString (dig "data" "path" "" .Values.run.config) }}
{{- if and (hasPrefix "s3://" $path) (gt (.Values.data.waitSeconds | int) 0) }}
# Waits until the dataset is in its bucket (data.waitSeconds), then `prepare` runs.
- name: wait-for-data
  image: {{ include "ance-train.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - python
    - -c
    - |
      import os, sys, time
      from ance_train.config import load_config
      from ance_train.data.formats import DatasetFiles
      from ance_train.data.problems import DataError
      from ance_train.infra.store import StorageError
      data = load_config(os.environ["ANCE_CONFIG"]).data
      wait_s, poll_s = float(sys.argv[1]), float(sys.argv[2])
      deadline = time.monotonic() + wait_s
      while True:
          try:
              DatasetFiles.resolve(data)
          except (DataError, StorageError, OSError) as missing:
              if time.monotonic() >= deadline:
                  sys.exit(f"gave up after {wait_s:g} s waiting for the dataset: {missing}")
              print(f"waiting for the dataset in {data.path} (docs/deployment.md, section 2): "
                    f"{missing}", flush=True)
              time.sleep(poll_s)
          else:
              print(f"the dataset is in {data.path}", flush=True)
              break
    - {{ .Values.data.waitSeconds | int | quote }}
    - "15"
  env:
    {{- include "ance-train.env" . | nindent 4 }}
  volumeMounts:
    {{- include "ance-train.volumeMounts" . | nindent 4 }}
  resources:
    {{- toYaml .Values.trainer.prepare.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.containerSecurityContext | nindent 4 }}
{{- end }}
{{- end }}
