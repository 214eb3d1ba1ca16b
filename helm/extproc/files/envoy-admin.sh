#!/bin/bash
# Envoy's probes and its preStop drain, through the admin API on 127.0.0.1 only.
#
#   envoy-admin.sh ready   exit 0 iff GET /ready answers 200 (LIVE; 503 while starting/draining)
#   envoy-admin.sh live    exit 0 iff GET /server_info answers 200 (the process serves admin)
#   envoy-admin.sh drain   preStop: fail health checks, drain listeners gracefully, then wait
#                          until no downstream request is active (at least DRAIN_MIN_S, at
#                          most DRAIN_MAX_S seconds) so in-flight generations finish before
#                          the kubelet sends SIGTERM (on which Envoy exits at once).
#
# Pure bash (/dev/tcp): the envoyproxy/envoy image has no curl, and the admin endpoint is never
# exposed on the pod network. Environment: ENVOY_ADMIN_PORT (9901), DRAIN_MIN_S (5),
# DRAIN_MAX_S (30).
set -u
export LC_ALL=C  # read -N counts bytes
port="${ENVOY_ADMIN_PORT:-9901}"

# admin METHOD PATH: sets $status (HTTP code, 0 if unreachable) and $body.
# HTTP/1.1 (Envoy refuses 1.0 with a 426), so a chunked body is decoded here.
admin() {
  status=0 body=""
  { exec 3<>"/dev/tcp/127.0.0.1/${port}"; } 2>/dev/null || return 1
  printf '%s %s HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n' \
    "$1" "$2" >&3
  local line size chunk chunked=""
  IFS=' ' read -r -t 5 _ status _ <&3 || status=0
  while IFS= read -r -t 5 line <&3; do
    line="${line%$'\r'}"
    [ -z "$line" ] && break
    case "${line,,}" in transfer-encoding:*chunked*) chunked=1 ;; esac
  done
  if [ -n "$chunked" ]; then
    while IFS= read -r -t 5 line <&3; do
      size=$((16#${line%%[;$'\r']*}))
      [ "$size" -eq 0 ] && break
      IFS= read -r -N "$size" -t 5 chunk <&3 || break
      body+="$chunk"
      read -r -t 5 _ <&3   # the CRLF that ends the chunk
    done
  else
    body="$(timeout 5 cat <&3 2>/dev/null || true)"
  fi
  exec 3<&- 3>&-
  [ "$status" = 200 ]
}

# Requests in flight on every HTTP listener but the admin endpoint itself.
active() {
  admin GET '/stats?filter=downstream_rq_active' || { echo 0; return; }
  local total=0 name value
  while read -r name value; do
    case "$name" in
      http.admin.*) ;;
      http.*.downstream_rq_active:) total=$((total + ${value:-0})) ;;
    esac
  done <<<"$body"
  echo "$total"
}

case "${1:-}" in
  ready) admin GET /ready ;;
  live) admin GET /server_info ;;
  drain)
    min="${DRAIN_MIN_S:-5}" max="${DRAIN_MAX_S:-30}"
    admin POST /healthcheck/fail || true
    admin POST '/drain_listeners?graceful&inboundonly' || true
    start=$SECONDS
    while [ $((SECONDS - start)) -lt "$max" ]; do
      if [ $((SECONDS - start)) -ge "$min" ] && [ "$(active)" = 0 ]; then
        break
      fi
      sleep 1
    done
    exit 0
    ;;
  *) echo "usage: $0 ready|live|drain" >&2; exit 2 ;;
esac
