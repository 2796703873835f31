#!/usr/bin/env bash
# SMG (the Shepherd Model Gateway, PyPI `smg`, SGLang's router's successor) in front of several tinyserve workers:
# the agents talk to it as to one tinyserve; it keeps each agent session on one worker (whose prefix cache holds the
# session), spreads new sessions over the workers, reads each worker's load (GET /v1/loads) and moves a session to
# another worker when its own is gone or draining (that worker reads the session from the shared cache folder).
# Run by systemd/smg.service; one comment per choice. Tested by tests/test_gateway.py (and Claude Code through it by
# tests/agents/test_agent_gateway.py) with smg 1.13.0.
#
#   WORKERS="http://10.0.0.11:8000 http://10.0.0.12:8000" bash systemd/smg.sh [more smg flags]
#
# WORKERS: the tinyserve workers, space-separated (each on systemd/tinyserve.service with server.host = "0.0.0.0"
# and the same cache.file.dir on a share: docs/scale-out.md). SMG_HOST / SMG_PORT: where agents connect (the port a
# single tinyserve had, so the agents' set-up lines only change the host). SMG: the smg binary.
set -euo pipefail
: "${WORKERS:?set WORKERS to the workers URLs, e.g. WORKERS=\"http://10.0.0.11:8000 http://10.0.0.12:8000\"}"
# shellcheck disable=SC2206  # WORKERS is split into one URL per word on purpose
args=(
    launch
    --host "${SMG_HOST:-0.0.0.0}"
    --port "${SMG_PORT:-8000}"
    --worker-urls $WORKERS
    # Prometheus metrics of the gateway itself (routing decisions, per-worker loads); tinyserve's own stay on each
    # worker's /metrics.
    --prometheus-port "${SMG_PROMETHEUS_PORT:-29000}"

    # Sessions stay on their worker. Every agent sends a session id of its own on each request (Claude Code
    # X-Claude-Code-Session-Id, Codex session-id, opencode x-session-affinity); the first of these headers present
    # is the routing key, pinned to one worker for as long as the session is used (--max-idle-secs, 4 hours by
    # default; an idle session that comes back after that is placed again and reads its prefix from the shared
    # folder). X-SMG-Routing-Key is for clients without a session header: set it per session through the client's
    # custom-header setting (docs/scale-out.md).
    --routing-key-override
    --routing-key-headers x-claude-code-session-id session-id x-session-affinity x-smg-routing-key
    # A new session goes to the worker running the fewest sessions now (ties: either), not to the one that cached
    # the agents' shared system prompt first (cache-aware placement would put every session there: that prefix is
    # the same for all of them and cheap to compute once per worker).
    --assignment-mode min_group

    # Requests without a session key (scripts, Qwen Code) follow their prefix: the worker whose cache holds the
    # longest part of the prompt (SMG's approximate tree of the prompts it sent, which needs nothing from the worker).
    --policy cache_aware
    # ... unless that worker runs three or more requests beyond the other's (more than the mean + 1, and above
    # the mean): then the least loaded takes it. SMG's default (64 in flight) is a data-centre figure, at which a
    # home fleet never spreads; lower would move sessions away from their cache on every overlap of two turns.
    --balance-abs-threshold 1
    --balance-rel-threshold 1.0

    # A worker that is draining (SIGTERM: its /health answers 503) or gone is out within ~4 s (two failed probes
    # 2 s apart; the default, 3 x 60 s, keeps sending it sessions for minutes). Requests that meet it before that
    # are retried on another worker (SMG retries 503 and refused connections, 5 tries with backoff, by default).
    --health-check-interval-secs 2
    --health-failure-threshold 2

    # The Responses API passes through to the workers, which keep no responses (they answer store: true with
    # store: false; previous_response_id is refused): there is no response history to keep here either.
    --history-backend none

    --log-level info
)
# With server.api_key on the workers add `--api-key KEY`: SMG sends it on its own calls (/v1/models, /v1/loads).
# Clients must then send the key as `Authorization: Bearer` (SMG drops x-api-key): Claude Code's
# ANTHROPIC_AUTH_TOKEN, not ANTHROPIC_API_KEY.
exec "${SMG:-/opt/smg/.venv/bin/smg}" "${args[@]}" "$@"
