{{/*
A worker role (trainer or rollout): a headless Service for stable pod DNS and a StatefulSet whose
ordinals are ranks. The coordinator finds the ready pods through the Kubernetes API, so the
Service only gives them names. Call with (dict "root" $ "role" "trainer" "service" "rlfleet.v1.Trainer" "replicas" N).
*/}}
{{- define "rlfleet.worker" -}}
{{- $root := .root }}
{{- $name := printf "%s-%s" (include "rlfleet.fullname" $root) .role }}
{{- $ctx := dict "root" $root "component" .role }}
{{- $pod := dict "root" $root "role" .role "component" .role "block" .role }}
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  labels:
    {{- include "rlfleet.labels" $ctx | nindent 4 }}
spec:
  clusterIP: None
  publishNotReadyAddresses: true
  selector:
    {{- include "rlfleet.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: grpc
      port: 50051
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
---
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ $name }}
  labels:
    {{- include "rlfleet.labels" $ctx | nindent 4 }}
spec:
  serviceName: {{ $name }}
  replicas: {{ int .replicas }}
  podManagementPolicy: Parallel
  selector:
    matchLabels:
      {{- include "rlfleet.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      {{- include "rlfleet.podMetadata" $pod | nindent 6 }}
    spec:
      automountServiceAccountToken: false
      enableServiceLinks: false
      terminationGracePeriodSeconds: 30
      securityContext:
        {{- include "rlfleet.podSecurityContext" $root | nindent 8 }}
      {{- with include "rlfleet.scheduling" $pod }}{{ . | nindent 6 }}{{ end }}
      containers:
        - name: {{ .role }}
          image: {{ include "rlfleet.workerImage" (dict "root" $root "role" .role) }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            - serve
            - {{ .role }}
            - --host=0.0.0.0
            - --port=50051
            - --log-level={{ $root.Values.logLevel }}
            {{- if and (eq .role "trainer") $root.Values.sharedStorage.enabled }}
            # Checkpoints are written and read under the shared volume only, where the coordinator
            # (which names their paths) has it mounted as well.
            - --checkpoint-root={{ $root.Values.sharedStorage.mountPath }}
            {{- end }}
            {{- include "rlfleet.tokenArgs" $root | nindent 12 }}
            {{- include "rlfleet.tlsArgs" $root | nindent 12 }}
          ports:
            - name: grpc
              containerPort: 50051
              protocol: TCP
          env:
            {{- include "rlfleet.env" $pod | nindent 12 }}
          {{- include "rlfleet.probes" (dict "root" $root "service" .service "readiness" true) | nindent 10 }}
          resources:
            {{- include "rlfleet.resources" (dict "root" $root "role" .role) | nindent 12 }}
          securityContext:
            {{- include "rlfleet.containerSecurityContext" $root | nindent 12 }}
          volumeMounts:
            {{- include "rlfleet.volumeMounts" $root | nindent 12 }}
            {{- include "rlfleet.sharedMount" $pod | nindent 12 }}
            # NCCL, gloo and the shm weight plane need more than the runtime's 64 MiB /dev/shm.
            - name: dshm
              mountPath: /dev/shm
      volumes:
        {{- include "rlfleet.volumes" $root | nindent 8 }}
        {{- include "rlfleet.sharedVolume" $pod | nindent 8 }}
        - name: dshm
          emptyDir:
            medium: Memory
            {{- if and (eq .role "rollout") (eq (include "rlfleet.rolloutEngine" $root) "sglang") }}
            sizeLimit: {{ $root.Values.sglang.shmSize }}
            {{- end }}
{{- end }}
