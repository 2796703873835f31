#!/usr/bin/env bash
# The four coding-agent CLIs that tests/agents runs, pinned, from the npm registry into one folder:
#   bash tests/agents/install.sh [DIR]     (default: $TINYSERVE_AGENTS_DIR, else ~/.cache/tinyserve/agents)
# Idempotent: a folder that holds these versions already is left as it is. Prints the folder.
# Bump a version here and in docs/clients.md ("Tested with") together.
set -euo pipefail
DIR=${1:-${TINYSERVE_AGENTS_DIR:-$HOME/.cache/tinyserve/agents}}
PACKAGES=(
    "@anthropic-ai/claude-code@2.1.332"
    "@openai/codex@0.171.0"
    "@qwen-code/qwen-code@0.24.4"
    "opencode-ai@1.18.33"
)
mkdir -p "$DIR"
want=$(printf '%s\n' "${PACKAGES[@]}")
if [ "$(cat "$DIR/.installed" 2>/dev/null)" != "$want" ]; then
    # the packages' own install scripts only copy the platform binary into place (no downloads)
    npm install --prefix "$DIR" --no-audit --no-fund --no-save --loglevel=error "${PACKAGES[@]}" >&2
    printf '%s\n' "$want" > "$DIR/.installed"
fi
for bin in claude codex qwen opencode; do
    [ -x "$DIR/node_modules/.bin/$bin" ] || { echo "install.sh: $bin is missing from $DIR" >&2; exit 1; }
done
echo "$DIR"
