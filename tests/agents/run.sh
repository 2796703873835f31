#!/usr/bin/env bash
# The real-agents tier: the releases of Claude Code, Codex, Qwen Code and opencode in tests/agents/releases.txt
# against `tinyserve config.example.toml` (tests/agents/test_agent_clis.py), and the newest Claude Code through the
# SMG gateway of systemd/smg.sh (tests/agents/test_agent_gateway.py). From the repository root, with the test
# dependencies installed:
#   bash tests/agents/run.sh [pytest args]              (-k claude: one agent's releases; -k codex-0.133.0: one)
# It installs the releases (tests/agents/install.sh), then runs the tier in a network namespace of its own where
# `unshare --net` is allowed (root, or user namespaces): only loopback is reachable there, so nothing but the
# server can answer the agents. Elsewhere it runs as it is, with the agents' vendor traffic switched off by their
# own settings (docs/clients.md) and says so.
set -euo pipefail
cd "$(dirname "$0")/../.."
export TINYSERVE_AGENTS_DIR=$(bash tests/agents/install.sh)
cmd=(python -m pytest -q -p no:cacheprovider -o addopts= -n0 --agents tests/agents "$@")
if unshare --net --map-root-user true 2>/dev/null && command -v ip >/dev/null; then
    exec unshare --net --map-root-user -- bash -c 'ip link set lo up && TINYSERVE_AGENTS_NETNS=1 exec "$@"' _ "${cmd[@]}"
fi
echo "run.sh: unshare --net is not allowed here; the agents run with the host's network" >&2
exec "${cmd[@]}"
