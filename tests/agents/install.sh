#!/usr/bin/env bash
# The coding-agent releases that tests/agents runs (tests/agents/releases.txt), from the npm registry, each release
# into a folder of its own:
#   bash tests/agents/install.sh [DIR]     (default: $TINYSERVE_AGENTS_DIR, else ~/.cache/tinyserve/agents)
# DIR/<agent>-<version>/node_modules/.bin/<agent>. A release installed already is left as it is. Prints DIR.
# TINYSERVE_AGENTS_LATEST=1 also installs each agent's @latest and lists it in DIR/latest.txt (`<agent> <version>`),
# so a run before a user updates catches what the next release changes.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${1:-${TINYSERVE_AGENTS_DIR:-$HOME/.cache/tinyserve/agents}}
mkdir -p "$DIR"
install_release() {   # agent package version
    local folder="$DIR/$1-$3"
    if [ ! -x "$folder/node_modules/.bin/$1" ]; then
        # the packages' own install scripts only copy the platform binary into place (no downloads)
        npm install --prefix "$folder" --no-audit --no-fund --no-save --loglevel=error "$2@$3" >&2
    fi
    [ -x "$folder/node_modules/.bin/$1" ] || { echo "install.sh: $1 $3 is missing from $folder" >&2; exit 1; }
}
: > "$DIR/latest.txt.new"
while read -r agent package versions; do
    case "$agent" in ''|'#'*) continue ;; esac
    for version in $versions; do install_release "$agent" "$package" "$version"; done
    if [ "${TINYSERVE_AGENTS_LATEST:-}" = 1 ]; then
        latest=$(npm view "$package@latest" version)
        install_release "$agent" "$package" "$latest"
        echo "$agent $latest" >> "$DIR/latest.txt.new"
    fi
done < "$HERE/releases.txt"
mv "$DIR/latest.txt.new" "$DIR/latest.txt"
echo "$DIR"
